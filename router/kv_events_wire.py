"""vLLM 0.32's KV event wire format, decoded without importing vLLM.

A publisher (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) sends multipart
messages ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian sequence number counting
from 0 per publisher process, ``payload`` an ``EventBatch`` encoded by ``msgspec.msgpack``:
an array ``[ts, events, data_parallel_rank]`` (``array_like=True``, trailing defaults
omitted) whose events are maps tagged ``"type": "BlockStored" | "BlockRemoved" |
"AllBlocksCleared"`` (defaults omitted). The replay socket (ROUTER) answers a request
``(b"", start_seq)`` with ``(b"", topic, seq, payload)`` for every buffered batch from
``start_seq`` on, then ``(b"", b"", END_SEQ, b"")`` with ``END_SEQ = -1`` (signed).
"""

from __future__ import annotations

from typing import Any

import msgspec

from cache_policy import kv_events as ev

END_SEQ = -1


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | bytes | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


_BATCH = msgspec.msgpack.Decoder(_Batch)
_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


def decode_seq(frame: bytes) -> int:
    """The signed big-endian sequence number of one frame; ``ValueError`` unless 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> tuple[float, list[ev.KvEvent], int]:
    """``(ts, events, skipped)``: the batch's publish time (publisher's wall clock, seconds),
    its events as ``cache_policy.kv_events`` types, and how many events were of a kind this
    router does not know (left out). ``msgspec.DecodeError`` if the batch itself is garbage."""
    batch = _BATCH.decode(payload)
    out: list[ev.KvEvent] = []
    skipped = 0
    for raw in batch.events:
        try:
            out.append(_convert(_EVENT.decode(raw)))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
    return batch.ts, out, skipped


def _convert(e: BlockStored | BlockRemoved | AllBlocksCleared) -> ev.KvEvent:
    if isinstance(e, BlockStored):
        keys = None if e.extra_keys is None else tuple(_keys(k) for k in e.extra_keys)
        return ev.BlockStored(tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size,
                              keys, e.lora_name, e.medium, e.group_idx)
    if isinstance(e, BlockRemoved):
        return ev.BlockRemoved(tuple(e.block_hashes), e.medium, e.group_idx)
    return ev.AllBlocksCleared()


def _keys(k: Any) -> tuple | None:
    """One block's extra keys as a tuple (msgpack has no tuples: nested lists become tuples)."""
    if k is None:
        return None
    return tuple(tuple(x) if isinstance(x, list) else x for x in k) if isinstance(k, list) else (k,)
