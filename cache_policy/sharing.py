"""What several routers share about decisions, as plain values (DESIGN rule 7, issue 13).

Pure: the router's state layer (``router.state``) moves these values through Redis; the core
turns them into its own state. Three kinds:

* **Version snapshots** (:func:`versions_snapshot` / :func:`apply_versions`): the current
  version and policy, the versions loaded so far, the version each replica serves, and the
  replicas an update holds out of rotation. Written by the router that runs an update, applied
  by every other router before it opens new work, so no router salts new work with a version
  the replicas no longer serve. Only *update* rotation reasons (``updating``, ``failed: ...``)
  travel here; ``draining`` belongs to the replica registry.
* **Peer loads** (:class:`PeerLoad`): the in-flight share other routers hold on each replica,
  folded into the admission projection so N routers together respect the watermark.
* **Pins with start versions** (``DecisionCore.pins`` / ``adopt_pin``): first writer wins.
  While Redis cannot be reached, a key no router pinned yet goes to its :func:`rendezvous`
  replica, the same on every router that sees the same replicas, so a GRPO group whose members
  reach several routers during an outage still lands on one replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import xxhash

from cache_policy.types import ReplicaId
from cache_policy.versions import VersionBook, check_policy

UPDATE_REASONS = ("updating", "failed")
"""Rotation reasons owned by weight updates (shared with the version snapshot)."""


def is_update_reason(reason: str | None) -> bool:
    """Whether a rotation ``reason`` was set by a weight update (``updating``, ``failed: ...``)."""
    return reason == "updating" or left_paused(reason)


def left_paused(reason: str | None) -> bool:
    """Whether a rotation ``reason`` says a weight update left the replica paused: ``failed: ...``
    is set only when the update paused the engine and did not resume it (its weights undefined,
    its resume failed, or its engine hangs: ``router.weights.steps.Steps._resume``). Nothing
    kept there runs on until a later update resumes it."""
    return reason is not None and reason.startswith("failed")


@dataclass(frozen=True)
class PeerLoad:
    """Other routers' admitted work on one replica, summed over routers.

    ``requests``: engine requests in flight; ``committed``: KV blocks their tickets hold at
    their peak; ``unseen``: of those, blocks admitted after each router's last scrape began
    (not yet in the replica's usage metric). All >= 0.
    """

    requests: int = 0
    committed: int = 0
    unseen: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.committed, self.unseen) < 0:
            raise ValueError(f"peer load must be >= 0, got {self}")

    def __add__(self, other: "PeerLoad") -> "PeerLoad":
        return PeerLoad(self.requests + other.requests, self.committed + other.committed,
                        self.unseen + other.unseen)

    def as_list(self) -> list[int]:
        """``[requests, committed, unseen]`` (the wire form)."""
        return [self.requests, self.committed, self.unseen]


def sum_peer_loads(shares: Iterable[dict[ReplicaId, PeerLoad]]) -> dict[ReplicaId, PeerLoad]:
    """Per replica, the sum of several routers' shares."""
    out: dict[ReplicaId, PeerLoad] = {}
    for share in shares:
        for rid, load in share.items():
            out[rid] = out.get(rid, PeerLoad()) + load
    return out


@dataclass(frozen=True)
class VersionSnapshot:
    """What one router tells the others about versions: ``current`` version and ``policy``,
    ``history`` (versions loaded so far, ascending), ``loaded`` (replica, version or None)
    pairs, ``rotation`` (replica, update reason) pairs, and whether an update is in progress.
    """

    current: int | None
    policy: str
    history: tuple[int, ...] = ()
    loaded: tuple[tuple[ReplicaId, int | None], ...] = ()
    rotation: tuple[tuple[ReplicaId, str], ...] = ()
    updating: bool = False

    def __post_init__(self) -> None:
        check_policy(self.policy)
        assert list(self.history) == sorted(self.history), "bug: history must be ascending"

    def as_json(self) -> dict[str, Any]:
        """The wire form (a JSON object)."""
        return {"current": self.current, "policy": self.policy, "history": list(self.history),
                "loaded": dict(self.loaded), "rotation": dict(self.rotation), "updating": self.updating}

    @classmethod
    def from_json(cls, data: Any) -> "VersionSnapshot":
        """Parse the wire form; ValueError naming what is wrong."""
        try:
            current = data["current"]
            return cls(None if current is None else int(current), str(data["policy"]),
                       tuple(sorted(map(int, data.get("history", [])))),
                       tuple((ReplicaId(k), None if v is None else int(v)) for k, v in data["loaded"].items()),
                       tuple((ReplicaId(k), str(v)) for k, v in data.get("rotation", {}).items()),
                       bool(data.get("updating", False)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed version snapshot: {exc!r}") from exc


def versions_snapshot(book: VersionBook) -> VersionSnapshot:
    """``book``'s shareable state (update rotation reasons only)."""
    return VersionSnapshot(book.current, book.policy, tuple(book.history), tuple(book.loaded.items()),
                           tuple((rid, r) for rid, r in book.rotation.items() if is_update_reason(r)),
                           book.updating())


def apply_versions(book: VersionBook, snapshot: VersionSnapshot, known: Iterable[ReplicaId]) -> list[ReplicaId]:
    """Make ``book`` agree with ``snapshot`` for the ``known`` replicas; return the replicas
    whose loaded version changed.

    Replicas the snapshot does not name keep their state; a local ``draining`` (or other
    non-update) rotation reason is kept.
    """
    loaded, rotation = dict(snapshot.loaded), dict(snapshot.rotation)
    changed = []
    book.policy, book.current = snapshot.policy, snapshot.current  # type: ignore[assignment]
    history, have = snapshot.history, len(book.history)
    if len(history) >= have and history[:have] == tuple(book.history):  # it only adds (a week of
        book.history[:] = history  # updates: 20,000 entries, merged as sets in ~5 ms per apply)
    else:
        book.history[:] = sorted(set(book.history) | set(history))
    for rid in known:
        if rid in loaded and book.loaded.get(rid, -1) != loaded[rid]:
            book.set_loaded(rid, loaded[rid])
            changed.append(rid)
        local = book.rotation.get(rid)
        if local is None or is_update_reason(local):
            if rid in rotation:
                book.rotation[rid] = rotation[rid]
            else:
                book.rotation.pop(rid, None)
    return changed


def unconfirmed(book: VersionBook) -> None:
    """Forget what ``book`` believes about versions (a router that could not confirm them):
    no current version, no known history, every replica's version unknown, so no request is
    salted with a guess (a request's own ``weight_version`` still names its salt)."""
    book.current = None
    book.history.clear()  # a tagged request resolves to its own version, not to a stale one
    book.forget_loaded()


def rendezvous(key: str, replicas: Iterable[ReplicaId]) -> ReplicaId | None:
    """The replica of ``key`` by highest-random-weight hashing over ``replicas`` (None if none):
    every router computes the same one from the same set, and removing a replica moves only
    the keys it held."""
    best, best_score = None, -1
    for rid in replicas:
        score = xxhash.xxh64_intdigest(f"{key}\x00{rid}".encode())
        if score > best_score or (score == best_score and best is not None and rid < best):
            best, best_score = rid, score
    return best
