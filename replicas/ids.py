"""Replica names: replica ``i`` is ``"replica-{i}"`` for the replica set's whole life."""

from __future__ import annotations

from cache_policy.types import ReplicaId


def replica_id(index: int) -> ReplicaId:
    """The stable name of replica ``index``: ``"replica-{index}"``."""
    return ReplicaId(f"replica-{index}")


def replica_index(rid: ReplicaId) -> int:
    """The index in ``rid``; ``KeyError`` when it is not ``"replica-<n>"``."""
    prefix, _, num = str(rid).rpartition("-")
    if prefix != "replica" or not num.isdigit():
        raise KeyError(f"not a replica id: {rid!r} (expected 'replica-<n>')")
    return int(num)
