"""Background KV-event subscriber: every replica's vLLM events feed the prefix index.

One asyncio task per replica holds a ZMQ SUB socket on the replica's publisher and applies
each batch through ``cache_policy.kv_events.KvEventApplier``. Nothing here is on the request
path: a batch is decoded and applied between requests on the event loop (microseconds per
block), and every socket wait has a timeout. Per replica, by sequence number:

* the next expected batch: applied;
* a batch already applied (seen through a replay): skipped;
* a gap: the missing batches are asked from the replay socket and applied in order; if the
  replay cannot fill the gap (no replay socket, timeout, buffer rotated), the replica's index
  entries are forgotten (predictions and routing go on; events rebuild the truth);
* a number at or below the last one received live: the publisher restarted (a new engine,
  an empty cache): the replica's entries and hash table are dropped and counting restarts;
* garbage (wrong frame count, undecodable batch): counted and logged once; an undecodable
  batch in sequence loses its events, so the replica's entries are forgotten.

A fresh subscription expects sequence 0, so joining a running replica first replays what its
publisher still buffers. Any exception from a peer ends in a log line and a reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from cache_policy.kv_events import KvEventApplier
from cache_policy.types import ReplicaId
from replicas.kv_events import KvEventSource as EventSource
from router.kv_events_wire import END_SEQ, decode_batch, decode_seq

CLOSE_TIMEOUT_S = 2.0
"""How long ``close`` waits for the subscriptions to end before closing the ZMQ context under them."""

log = logging.getLogger(__name__)

RECV_TIMEOUT_S = 1.0
REPLAY_TIMEOUT_S = 2.0
RECONNECT_S = 1.0


@dataclass
class SubscriberStats:
    """Plain counters of one replica's subscription (``lag_s``: last batch's age on arrival)."""

    batches: int = 0
    gaps: int = 0
    gaps_repaired: int = 0
    gaps_lost: int = 0
    garbage: int = 0
    unknown_events: int = 0
    restarts: int = 0
    lag_s: float = 0.0
    next_seq: int = 0
    last_live: int = -1


class KvEventSubscriber:
    """Subscribes to replicas' KV events; ``watch`` / ``unwatch`` / ``close``. Event loop only."""

    def __init__(self, applier: KvEventApplier, *, clock: Callable[[], float] = time.monotonic,
                 recv_timeout_s: float = RECV_TIMEOUT_S, replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.applier = applier
        self.clock = clock
        self.recv_timeout_s = recv_timeout_s
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[ReplicaId, tuple[EventSource, asyncio.Task]] = {}
        self._stats: dict[ReplicaId, SubscriberStats] = {}

    def stats(self, rid: ReplicaId) -> SubscriberStats:
        """Counters of ``rid`` (zeros before its first batch)."""
        return self._stats.setdefault(rid, SubscriberStats())

    def snapshot(self) -> dict[str, float]:
        """Plain gauges and counters for ``/metrics``: the index (``index_entries``,
        ``index_predicted``, ``index_confirmed``, ``index_expired``) and, per replica,
        ``{rid}:{name}`` for the subscription's counters (``batches``, ``gaps``,
        ``gaps_repaired``, ``gaps_lost``, ``garbage``, ``restarts``, ``lag_s``) and the
        applier's (``events``, ``stored``, ``removed``, ``unmapped``, ``resets``)."""
        st = self.applier.index.stats()
        out = {"index_entries": st.entries, "index_predicted": st.predicted, "index_confirmed": st.confirmed,
               "index_expired": st.expired}
        for rid, stats in self._stats.items():
            counts = self.applier.counts(rid)
            for name in ("batches", "gaps", "gaps_repaired", "gaps_lost", "garbage", "restarts", "lag_s"):
                out[f"{rid}:{name}"] = getattr(stats, name)
            for name in ("events", "stored", "removed", "unmapped", "resets"):
                out[f"{rid}:{name}"] = getattr(counts, name)
        return out

    def watch(self, rid: ReplicaId, source: EventSource) -> None:
        """Subscribe to ``rid`` at ``source``; a new source (a restarted replica) replaces the old
        subscription and drops ``rid``'s entries and hash table."""
        current = self._tasks.get(rid)
        if current is not None and current[0] == source:
            return
        if current is not None:
            current[1].cancel()
            self.applier.restarted(rid)
        self._stats[rid] = SubscriberStats()
        self._tasks[rid] = (source, asyncio.create_task(self._run(rid, source), name=f"kv-events-{rid}"))

    def watched(self) -> list[ReplicaId]:
        """Replicas followed now."""
        return list(self._tasks)

    def unwatch(self, rid: ReplicaId) -> None:
        """Stop following ``rid`` (its index entries stay: the caller decides)."""
        current = self._tasks.pop(rid, None)
        if current is not None:
            current[1].cancel()

    async def close(self) -> None:
        """Cancel every subscription and close the ZMQ context."""
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)  # bounded: a stuck peer never holds shutdown
        self._ctx.destroy(linger=0)

    async def _run(self, rid: ReplicaId, source: EventSource) -> None:
        logged: set[str] = set()
        while True:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(source.endpoint)
                sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
                while True:
                    await self._receive(rid, source, sock, logged)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a peer's fault must never end the subscription
                if type(exc).__name__ not in logged:
                    logged.add(type(exc).__name__)
                    log.warning("kv events of %s at %s: %r; reconnecting", rid, source.endpoint, exc)
                await asyncio.sleep(RECONNECT_S)
            finally:
                sock.close(linger=0)

    async def _receive(self, rid: ReplicaId, source: EventSource, sock, logged: set[str]) -> None:
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races a message
            async with asyncio.timeout(self.recv_timeout_s):
                frames = await sock.recv_multipart()
        except TimeoutError:
            self.applier.index.expire(self.clock())  # keep the predictions' clock moving
            return
        stats = self.stats(rid)
        try:
            if len(frames) != 3:
                raise ValueError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            seq = decode_seq(frames[1])
        except ValueError as exc:
            self._garbage(rid, stats, exc, logged)
            return
        if seq <= stats.last_live:  # live numbers only grow: a new publisher process
            stats.restarts += 1
            self.applier.restarted(rid)
            stats.next_seq = 0
        stats.last_live = seq
        if seq > stats.next_seq:
            await self._repair(rid, source, stats, seq, logged)
        if seq == stats.next_seq:
            self._apply(rid, stats, seq, frames[2], logged)

    def _apply(self, rid: ReplicaId, stats: SubscriberStats, seq: int, payload: bytes, logged: set[str]) -> None:
        stats.next_seq = seq + 1
        try:
            ts, events, unknown = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._garbage(rid, stats, exc, logged)
            self.applier.forget(rid)  # its events are lost
            return
        stats.batches += 1
        stats.unknown_events += unknown
        stats.lag_s = max(0.0, time.time() - ts)
        self.applier.apply(rid, events, self.clock())

    async def _repair(self, rid: ReplicaId, source: EventSource, stats: SubscriberStats, upto: int,
                      logged: set[str]) -> None:
        """Fill ``[next_seq, upto)`` from the replay socket, or forget ``rid``'s entries."""
        stats.gaps += 1
        start = stats.next_seq
        replayed = await self._replay(source, start) if source.replay_endpoint else []
        for seq, payload in replayed:
            if seq == stats.next_seq:
                self._apply(rid, stats, seq, payload, logged)
        if stats.next_seq >= upto:
            stats.gaps_repaired += 1
            return
        stats.gaps_lost += 1
        log.info("kv events of %s: batches %d..%d lost, forgetting its index entries", rid, stats.next_seq, upto - 1)
        self.applier.forget(rid)
        stats.next_seq = upto

    async def _replay(self, source: EventSource, start: int) -> list[tuple[int, bytes]]:
        """Batches from ``start`` on that the publisher still buffers ([] on timeout)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(source.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = decode_seq(frames[2])
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[3]))
        except (asyncio.TimeoutError, ValueError):
            return out  # _repair checks what is contiguous
        finally:
            sock.close(linger=0)

    def _garbage(self, rid: ReplicaId, stats: SubscriberStats, exc: Exception, logged: set[str]) -> None:
        stats.garbage += 1
        if "garbage" not in logged:
            logged.add("garbage")
            log.warning("kv events of %s: garbage message (%s); skipped", rid, exc)


def sync_watches(subscriber: KvEventSubscriber, endpoints) -> None:
    """Follow exactly the ``endpoints`` (``ReplicaEndpoint``) that publish KV events; a replica
    whose source changed (restarted) is re-subscribed from scratch."""
    wanted = {ep.replica_id: ep.kv_events for ep in endpoints if ep.kv_events is not None}
    for rid in subscriber.watched():
        if rid not in wanted:
            subscriber.unwatch(rid)
    for rid, source in wanted.items():
        subscriber.watch(rid, source)


async def kv_events_ctx(app) -> AsyncIterator[None]:
    """aiohttp cleanup context: subscribe the decision core's prefix index to every replica's
    KV events (``router.kv_events`` in the config; a policy without an index needs none).
    ``app[KV_EVENTS]`` holds the subscriber (None when off)."""
    from router import keys

    core, cfg = app[keys.CORE], app[keys.CONFIG]
    index = core.prefix_index()
    if not cfg.router.kv_events or index is None:
        app[KV_EVENTS] = None
        yield
        return
    subscriber = KvEventSubscriber(KvEventApplier(index, core.block_size))
    app[KV_EVENTS] = subscriber
    sync_watches(subscriber, [s.endpoint for s in app[keys.POOL].states()])
    try:
        yield
    finally:
        await subscriber.close()


KV_EVENTS = web.AppKey("kv_events", object)
"""The app's ``KvEventSubscriber`` (None when events are off)."""
