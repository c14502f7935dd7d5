"""Session and group pins across routers: first writer wins, the loser follows (issue 13).

Per keyed request, at most two Redis calls, each bounded by ``router.redis_timeout_s`` (none
while the breaker is open, so only the requests in flight when Redis goes away pay the deadlines):

1. before ``core.open`` (:meth:`PinSync.read`, one MGET shared with the version epoch check):
   the pins of the request's session and group, with their start versions, are adopted into
   the core, so placement and keep+salt follow what other routers decided;
2. after ``core.place`` (:meth:`PinSync.claim`, the ``CLAIM`` script): the pin is written if
   absent or deliberately moved; if another router won meanwhile, the job moves to the winner
   (``DecisionCore.follow_pin``) before it is admitted or dispatched.

When Redis is unreachable the core's own pins decide (a session keeps the replica this router
knows), and a key this router has no pin for is pinned to its rendezvous replica
(``DecisionCore.pin_by_hash``: the same on every router, so a group does not split); the keys placed meanwhile are remembered (bounded) and claimed when Redis is back, and
every pin is re-published when Redis restarted empty. Pins other routers write arrive on the
``events`` channel and are adopted, so every router knows every live pin before Redis blinks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from cache_policy.core import DecisionCore, Job, RequestSpec
from cache_policy.types import ReplicaId
from router.state.redis_client import GuardedRedis, StateUnavailable
from router.state.wire import CLAIM, END_PIN, PIN_ENDED, Keys, decode_pin, encode_pin

log = logging.getLogger(__name__)

MAX_DIRTY = 100_000
"""Keys placed while Redis was unreachable, remembered for the reconcile (oldest dropped first)."""


@dataclass
class Seen:
    """What the read before ``open`` found: ``ok`` (Redis answered) and, per pin kind, the
    replica Redis named (None: no pin), the expected value of a later claim."""

    ok: bool
    pins: dict[str, ReplicaId | None] = field(default_factory=dict)



def pin_keys(spec: RequestSpec) -> list[tuple[str, str]]:
    """``[(kind, key)]`` of a request: its session, then its group."""
    return [(k, v) for k, v in (("session", spec.session_id), ("group", spec.group_id)) if v is not None]


class PinSync:
    """Pins between this router's core and Redis."""

    def __init__(self, redis: GuardedRedis, keys: Keys, ttl_s: int) -> None:
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s
        self.dirty: OrderedDict[tuple[str, str], ReplicaId | None] = OrderedDict()
        self.moved = 0
        """Jobs moved to another router's winning pin (a metric)."""

    async def read(self, core: DecisionCore, spec: RequestSpec, extra: list[str]) -> tuple[Seen, list]:
        """MGET ``extra`` keys + the request's pins; adopt the pins. Returns the ``Seen`` and the
        values of ``extra``. Never raises: Redis unreachable gives ``Seen(ok=False)``."""
        pins = pin_keys(spec)
        try:
            values = await self.redis.call(lambda c: c.mget(extra + [self.keys.pin(k, v) for k, v in pins]))
        except StateUnavailable:  # keys new to this router go where every router would put them
            now = time.monotonic()
            for kind, key in pins:
                core.pin_by_hash(kind, key, now)
            return Seen(False), [None] * len(extra)
        seen = Seen(True)
        for (kind, key), raw in zip(pins, values[len(extra):]):
            replica, start = decode_pin(raw)
            seen.pins[kind] = ReplicaId(replica) if replica else None
            core.adopt_pin(kind, key, seen.pins[kind], start, now=time.monotonic())
        return seen, values[:len(extra)]

    async def claim(self, core: DecisionCore, job: Job, seen: Seen | None, now: float) -> None:
        """Write ``job``'s pins (first writer wins) and follow the winner. Never raises."""
        pins = pin_keys(job.spec)
        if not pins or job.replica_id is None:
            return
        if seen is None or not self.redis.available:
            self._remember(pins, seen)
            return  # Redis is away (breaker open): claimed when it is back
        # (a read that failed once with the breaker still closed, e.g. a slow moment: claim as a
        # first writer would, so the job still follows another router's pin)
        start = job.choice.version if job.choice.version is not None else None
        record = {kind: core.registry.record_of(kind, key) for kind, key in pins}  # type: ignore[arg-type]
        args: list = [self.ttl_s, self.keys.events]
        for kind, key in pins:
            rec = record[kind]
            sv = rec.start_version if rec is not None and rec.start_version is not None else start
            args += [seen.pins.get(kind) or "", job.replica_id, "" if sv is None else sv]
        try:
            values = await self.redis.call(lambda c: c.eval(CLAIM, len(pins), *[self.keys.pin(k, v) for k, v in pins],
                                                             *args))
        except StateUnavailable:
            self._remember(pins, seen)
            return
        seen.ok = True
        self._follow(core, job, pins, seen, values, now)

    def _follow(self, core: DecisionCore, job: Job, pins, seen: Seen, values, now: float) -> None:
        winner = None
        for (kind, key), raw in zip(pins, values):
            replica, start = decode_pin(raw)
            seen.pins[kind] = ReplicaId(replica) if replica else None
            if start is not None:
                core.adopt_pin(kind, key, None, start, now=now)
            winner = winner or seen.pins[kind]  # the session's pin first, as placement reads them
        if winner is not None and winner != job.replica_id and core.follow_pin(job, winner, now) is not None:
            self.moved += 1
            for kind in seen.pins:
                seen.pins[kind] = winner

    def _remember(self, pins, seen: Seen | None) -> None:
        for kind, key in pins:
            self.dirty[(kind, key)] = seen.pins.get(kind) if seen is not None else None
            self.dirty.move_to_end((kind, key))
        while len(self.dirty) > MAX_DIRTY:
            self.dirty.popitem(last=False)

    async def republish(self, core: DecisionCore, *, everything: bool, timeout_s: float) -> int:
        """Claim the pins placed while Redis was unreachable (``everything``: all of the core's
        pins, after Redis restarted empty); adopt the winners. Returns how many were sent.
        Raises StateUnavailable (the caller retries on its next round)."""
        wanted = core.pins() if everything else [p for p in core.pins() if (p[0], p[1]) in self.dirty]
        expected = {} if everything else dict(self.dirty)
        for i in range(0, len(wanted), 500):
            chunk = wanted[i:i + 500]
            async def run(c, chunk=chunk):
                pipe = c.pipeline(transaction=False)
                for kind, key, rid, sv in chunk:
                    pipe.eval(CLAIM, 1, self.keys.pin(kind, key), self.ttl_s, self.keys.events,
                              expected.get((kind, key)) or "", rid, "" if sv is None else sv)
                return await pipe.execute()
            values = await self.redis.call(run, timeout_s=timeout_s, background=True)
            for (kind, key, rid, _), raw in zip(chunk, values):
                self.dirty.pop((kind, key), None)
                replica, start = decode_pin(raw[0] if isinstance(raw, list) else raw)
                core.adopt_pin(kind, key, ReplicaId(replica) if replica else None, start, now=time.monotonic())
        if everything:
            self.dirty.clear()
        return len(wanted)

    async def end(self, session_id: str) -> bool:
        """The client ended ``session_id``: drop its pin in Redis and tell every router
        (``END_PIN``, with a deadline on Redis's clock). True when Redis held it. Never raises.
        While Redis is unreachable or slow the end stays local to this router (the pin expires
        with its TTL): an end sent or run later could not tell the ended session from a new one
        another router started under the id meanwhile."""
        try:
            # the deadline on Redis's own clock: an end it runs after the caller gave up does nothing
            seconds, micros = await self.redis.call(lambda c: c.time())
            deadline = seconds * 1_000_000 + micros + int(self.redis.timeout_s * 1_000_000)
            return await self.redis.call(lambda c: c.eval(END_PIN, 1, self.keys.pin("session", session_id),
                                                          self.keys.events, PIN_ENDED, deadline)) == 1
        except StateUnavailable:
            return False

    def on_event(self, core: DecisionCore, fields: list[str]) -> bool:
        """A pin another router wrote (``events`` channel): adopt it; or a session it ended: end
        it here too. True when this router ended a session it held (admission may admit more)."""
        if len(fields) != 2 or not fields[0].startswith(self.keys.prefix + "pin:"):
            return False
        kind, _, key = fields[0][len(self.keys.prefix) + 4:].partition(":")
        if fields[1] == PIN_ENDED:
            return kind == "session" and core.end_session(key)
        replica, start = decode_pin(fields[1])
        core.adopt_pin(kind, key, ReplicaId(replica) if replica else None, start, now=time.monotonic())
        return False


__all__ = ["PinSync", "Seen", "encode_pin", "pin_keys"]
