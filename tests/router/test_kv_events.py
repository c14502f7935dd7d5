"""The KV-event subscriber against vLLM's own publisher and encoder (no engine needed).

vLLM's ``ZmqEventPublisher`` (real ZMQ PUB + replay ROUTER on ``ipc://`` sockets in a temp
folder) publishes batches built from vLLM's event classes; the router decodes them without
vLLM. Gaps are made by consuming a sequence number the publisher never sends.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vk

from cache_policy.hashing import block_hashes
from cache_policy.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventApplier
from cache_policy.prefix_index import PrefixIndex
from cache_policy.types import ReplicaId
from replicas.kv_events import KvEventSource, parse_sources
from router.kv_events import KvEventSubscriber
from router.kv_events_wire import decode_batch

R = ReplicaId("replica-0")
BS = 32


def toks(n: int, base: int) -> list[int]:
    return [(base * 7919 + i * 31) % 30_000 + 5 for i in range(n)]


def vstored(tokens: list[int], engine: list[int], parent=None, salt=None) -> vk.BlockStored:
    keys = None if salt is None else [(salt,)] + [None] * (len(engine) - 1)
    return vk.BlockStored(block_hashes=engine, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                          lora_id=None, medium="GPU", lora_name=None, extra_keys=keys, group_idx=0)


def batch(*events) -> vk.KVEventBatch:
    return vk.KVEventBatch(ts=time.time(), events=list(events))


def test_decode_matches_vllms_encoding() -> None:
    t = toks(64, 1)
    payload = msgspec.msgpack.Encoder().encode(batch(
        vstored(t, [11, 12], salt="v3"), vk.BlockRemoved(block_hashes=[11], medium="GPU"), vk.AllBlocksCleared()))
    ts, events, unknown = decode_batch(payload)
    assert unknown == 0 and ts > 0
    assert events == [BlockStored((11, 12), None, tuple(t), BS, (("v3",), None), None, "GPU", 0),
                      BlockRemoved((11,), "GPU", None), AllBlocksCleared()]


def test_parse_sources() -> None:
    answer = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5",
                    "replay_endpoint": "tcp://127.0.0.1:6", "topic": "kv-events"}}
    assert parse_sources(answer) == KvEventSource("tcp://127.0.0.1:5", "tcp://127.0.0.1:6", "kv-events")
    assert parse_sources({}) is None
    assert parse_sources({"0": {"enable_kv_cache_events": False, "publisher": "null"}}) is None


@pytest.fixture
def ipc(tmp_path):
    return lambda name: f"ipc://{tmp_path}/{name}"


def publisher(ipc, buffer_steps: int = 100) -> vk.ZmqEventPublisher:
    return vk.ZmqEventPublisher(0, endpoint=ipc("pub"), replay_endpoint=ipc("replay"),
                                buffer_steps=buffer_steps, topic="kv")


async def until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_subscriber_applies_repairs_and_forgets(ipc) -> None:
    index = PrefixIndex(10_000)
    sub = KvEventSubscriber(KvEventApplier(index, BS), recv_timeout_s=0.2, replay_timeout_s=1.0)
    pub = publisher(ipc)
    a, b, c = toks(64, 1), toks(96, 2), toks(32, 3)
    try:
        pub.publish(batch(vstored(a, [1, 2], salt="v1")))  # seq 0, before anyone listens
        await asyncio.sleep(0.2)
        sub.watch(R, KvEventSource(ipc("pub"), ipc("replay"), "kv"))
        await asyncio.sleep(0.5)  # the SUB joins
        pub.publish(batch(vstored(b, [3, 4, 5])))  # seq 1 live: gap [0, 1) repaired from replay
        await until(lambda: index.match(block_hashes(b, BS)) == {R: 3})
        assert index.match(block_hashes(a, BS, "v1")) == {R: 2}
        assert (sub.stats(R).gaps, sub.stats(R).gaps_repaired) == (1, 1)
        next(pub._seq_gen)  # seq 2 is lost: never sent, never buffered
        pub.publish(batch(vstored(c, [6])))  # seq 3
        await until(lambda: sub.stats(R).gaps_lost == 1)
        await until(lambda: index.match(block_hashes(c, BS)) == {R: 1})
        assert index.match(block_hashes(b, BS)) == {}  # forgotten: the truth was lost
        assert sub.stats(R).next_seq == 4
    finally:
        await sub.close()
        pub.shutdown()


async def test_subscriber_survives_a_publisher_restart(ipc) -> None:
    index = PrefixIndex(10_000)
    sub = KvEventSubscriber(KvEventApplier(index, BS), recv_timeout_s=0.2, replay_timeout_s=1.0)
    a, b = toks(64, 4), toks(64, 5)
    pub = publisher(ipc)
    try:
        sub.watch(R, KvEventSource(ipc("pub"), ipc("replay"), "kv"))
        await asyncio.sleep(0.5)
        for engine in ([1, 2], [3, 4], [5, 6]):
            pub.publish(batch(vstored(a, engine)))
        await until(lambda: sub.stats(R).next_seq == 3)
        pub.shutdown()
        pub = publisher(ipc)  # a new engine on the same endpoint counts from 0 again
        await asyncio.sleep(0.5)
        pub.publish(batch(vstored(b, [1, 2])))
        pub.publish(batch(vstored(b, [1, 2])))
        await until(lambda: sub.stats(R).restarts == 1 and sub.stats(R).next_seq == 2)
        assert index.match(block_hashes(a, BS)) == {} and index.match(block_hashes(b, BS)) == {R: 2}
    finally:
        await sub.close()
        pub.shutdown()


async def test_subscriber_survives_garbage(ipc) -> None:
    index = PrefixIndex(10_000)
    sub = KvEventSubscriber(KvEventApplier(index, BS), recv_timeout_s=0.2)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(ipc("raw"))
    t = toks(64, 6)
    good = msgspec.msgpack.Encoder().encode(batch(vstored(t, [1, 2])))
    try:
        sub.watch(R, KvEventSource(ipc("raw"), None, ""))
        await asyncio.sleep(0.5)
        pub.send_multipart([b"", b"not a sequence", good])  # bad sequence frame
        pub.send_multipart([b"only two", b"frames"])
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])  # seq 0 lost to garbage
        pub.send_multipart([b"", (1).to_bytes(8, "big"), good])
        await until(lambda: index.match(block_hashes(t, BS)) == {R: 2})
        assert sub.stats(R).garbage == 3 and sub.stats(R).batches == 1
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.term()


async def test_snapshot_counts_what_was_applied(ipc) -> None:
    index = PrefixIndex(10_000)
    sub = KvEventSubscriber(KvEventApplier(index, BS), recv_timeout_s=0.2)
    pub = publisher(ipc)
    t = toks(96, 7)
    try:
        sub.watch(R, KvEventSource(ipc("pub"), ipc("replay"), "kv"))
        await asyncio.sleep(0.5)
        pub.publish(batch(vstored(t, [1, 2, 3]), vk.BlockRemoved(block_hashes=[3], medium="GPU")))
        await until(lambda: sub.stats(R).batches == 1)
        index.insert(block_hashes(toks(64, 8), BS), R)  # two predicted blocks
        snap = sub.snapshot()
        assert (snap["index_entries"], snap["index_confirmed"], snap["index_predicted"]) == (4, 2, 2)
        assert (snap[f"{R}:events"], snap[f"{R}:stored"], snap[f"{R}:removed"], snap[f"{R}:batches"]) == (2, 3, 1, 1)
    finally:
        await sub.close()
        pub.shutdown()
