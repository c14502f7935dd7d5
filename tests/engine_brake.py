"""Stop and start a real vLLM replica's engine processes (SIGSTOP / SIGCONT) from a test.

A test that needs "this request is still decoding when the update pauses / the replica dies /
the second request arrives" cannot get it from timing on a loaded 2-core machine: there the
engine core's busy loop can decode a 1,000-token stream before its API server (or the router)
has relayed the first event. :class:`EngineBrake` makes it true by construction: it stops every
process of the replica's group except the API server (engine core, workers), so the API server
still answers HTTP and queues RPCs while no token is computed; ``release`` lets them run again.

``throttle`` runs the engine in short bursts (``run_s`` on, ``stop_s`` off) so the API server and
the router keep up with it; ``hold_when(cond)`` throttles until ``cond()`` is true with the
engine stopped and returns with it held. Always used as an async context manager, so the engine
is released whatever the test does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections import deque
import time
from collections.abc import AsyncIterator, Callable, Sequence

from replicas.procs import group_members, parent_of


class EngineBrake:
    """SIGSTOP / SIGCONT for the engine processes of the replica whose API server is ``pgid``."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.held = False
        self.holds = 0
        """How many times :meth:`hold` has stopped the engine (a condition can tell a new hold)."""
        self._stopped: list[int] = []
        self._engine: list[int] = []
        self._closed = False
        """Left its ``async with``: a burst thread still running then must not stop the engine
        again (a cancelled ``hold_when`` cannot stop its thread; it would leave the shared
        replica stopped for every later test)."""

    async def __aenter__(self) -> "EngineBrake":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closed = True
        self.release()

    def hold(self) -> None:
        """Stop the engine processes (the API server keeps running). Idempotent; nothing once
        the brake's ``async with`` has ended."""
        if self.held or self._closed:
            return
        if not self._engine:  # read once: /proc can be slow to walk on a loaded machine
            self._engine = [p for p in group_members(self.pgid) if p != self.pgid]
            assert self._engine, f"replica {self.pgid} has no engine process to stop"
        self._stopped = list(self._engine)
        for pid in self._stopped:
            _signal(pid, signal.SIGSTOP)
        self.held = True
        self.holds += 1

    def release(self) -> None:
        """Let the stopped processes run again (those still alive). Idempotent."""
        for pid in self._stopped:
            _signal(pid, signal.SIGCONT)
        self._stopped, self.held = [], False

    @contextlib.asynccontextmanager
    async def throttled(self, run_s: float = 0.005, stop_s: float = 0.05) -> AsyncIterator["EngineBrake"]:
        """While inside, the engine runs ``run_s`` seconds of every ``run_s + stop_s``: a long stream
        goes on for many times longer, while a short request still gets its few steps.

        The cycle runs in a thread of its own: as an asyncio task, its ``run_s`` sleep lasted as
        long as the test's event loop was busy (relaying a fast engine's backlog of stream chunks),
        and a 2% duty cycle let the engine decode 16,000 tokens in 44 s."""
        done = threading.Event()

        def cycle() -> None:
            _urgent()
            while not done.is_set():
                self.hold()
                if done.wait(stop_s):
                    break
                self.release()
                done.wait(run_s)

        thread = threading.Thread(target=cycle, name="engine-brake", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            await asyncio.to_thread(thread.join)
            self.release()

    async def hold_when(self, cond: Callable[[], bool], timeout_s: float = 120.0, *, run_s: float = 0.01,
                        max_run_s: float = 0.2, settle_s: float = 1.0, what: str = "the condition",
                        watch: Sequence[asyncio.Future] = ()) -> None:
        """Run the engine in bursts, starting at ``run_s`` seconds and doubling up to ``max_run_s``
        (a burst may be too short for one engine step); after each, hold it and poll ``cond()`` for
        up to ``settle_s`` seconds (the API server and the router relay what the burst made: on a
        loaded machine that lags the engine by seconds); return held once ``cond()`` is true.
        Raises AssertionError naming ``what`` after ``timeout_s``; with ``watch`` (the tasks that
        make ``cond()`` come true), re-raises the first one's error as soon as one fails, and raises
        :class:`Finished` once all of them finished without ``cond()`` (waiting on could not help)."""
        deadline = time.monotonic() + timeout_s
        burst = run_s
        while True:
            self.hold()
            settled = time.monotonic() + settle_s
            while True:
                if cond():
                    return
                _check_watched(watch, what + self._story(cond))
                if time.monotonic() >= settled:
                    break
                await asyncio.sleep(0.02)
            assert time.monotonic() < deadline, f"{what} never held within {timeout_s} s{self._story(cond)}"
            await _in_own_thread(self._run_for, burst)  # timed in a thread: a busy loop overshot it
            burst = min(2 * burst, max_run_s)

    def _story(self, cond: Callable[[], bool]) -> str:
        """What a failed wait saw: the holds so far and the condition's last observations, where it
        keeps them (``relaying``: time, flights on the replica, tokens each stream relayed)."""
        seen = list(getattr(cond, "history", ()))
        return f" ({self.holds} holds, engine pids {self._engine}; last seen (t, flights, stream tokens): {seen})"

    def _run_for(self, seconds: float) -> None:
        """Release the engine, let it run ``seconds``, hold it again. Released here, in the worker
        thread, not before handing over to it: a worker can start late (the default executor's
        threads busy with the router's DNS lookups and tokenizer calls) and the engine then ran
        unheld for that long (a full run saw a group's 2 x 1,200 tokens decoded in 4 'bursts').
        Its own thread, made urgent (:func:`_urgent`), not the default executor's."""
        _urgent()
        self.release()
        time.sleep(seconds)
        self.hold()


class Finished(AssertionError):
    """``hold_when``: every watched task finished (without error) before the condition held."""


def _check_watched(watch: Sequence[asyncio.Future], what: str) -> None:
    """Raise what a failed task in ``watch`` raised; :class:`Finished` when all of them are done."""
    for task in watch:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    if watch and all(task.done() for task in watch):
        raise Finished(f"every task {what} waited on finished before it held: {[t.result() for t in watch]}")


async def engine_core_of(replica_set, rid: str, timeout_s: float = 60.0) -> tuple[int, int]:
    """``(pgid, engine core pid)`` of replica ``rid``, waiting until its group shows exactly one
    EngineCore (a replica just restarted can be announced before ``/proc`` shows its title)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pgid = (await replica_set.info(rid)).pid
        cores = engine_core_pids(pgid)
        if len(cores) == 1:
            return pgid, cores[0]
        assert time.monotonic() < deadline, (f"replica {rid} (group {pgid}) shows engine cores {cores}; "
                                             f"members: {_cmdlines(group_members(pgid))}")
        await asyncio.sleep(0.2)


def engine_core_pids(pgid: int) -> list[int]:
    """Pids in ``pgid``'s group whose title names vLLM's EngineCore (``set_process_title`` in
    ``vllm/v1/engine/core.py``): the command line, or the kernel's 15-byte name
    (``VLLM::EngineCor``), which ``setproctitle`` also sets and which stays readable when
    rewriting the command line did not take (a full run once saw no titled core for 60 s).
    With no titled process, the EngineCore is the API server's untitled child: a fork of it with
    its command line (``get_mp_context`` in ``vllm/utils/system_utils.py``: fork unless
    ``VLLM_WORKER_MULTIPROC_METHOD`` says spawn) or a ``multiprocessing`` spawn child
    (``spawn_main``): a slow host's full run (session 17) saw no titled process for 60 s again."""
    out, untitled = [], []
    leader = _cmdline(pgid)
    for pid in group_members(pgid):
        cmdline = _cmdline(pid)
        if cmdline is None:
            continue
        titled = b"EngineCore" in cmdline
        if pid != pgid and parent_of(pid) == pgid and (cmdline == leader or b"spawn_main" in cmdline):
            untitled.append(pid)
        try:
            if not titled:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    titled = f.read().startswith(b"VLLM::EngineCor")
        except OSError:
            continue
        if titled:
            out.append(pid)
    return out or (untitled if len(untitled) == 1 else [])


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _cmdlines(pids: list[int]) -> dict[int, str]:
    """Each pid's command line (truncated), for a failed wait's message."""
    return {pid: (_cmdline(pid) or b"(gone)").replace(b"\0", b" ").decode(errors="replace")[:120] for pid in pids}


def _urgent() -> None:
    """Make the calling thread real-time (SCHED_FIFO, priority 1) where the process may (root):
    it must wake the moment its sleep ends to stop the engine again, and a running vLLM-CPU
    engine keeps every core busy (its OpenMP threads spin), so an ordinary thread could wake
    late and a "3 ms" burst run far longer (a CI run's throttled engine decoded a 16,000-token
    stream to its end in each of three tries, `vllm:generation_tokens_total` +16,003 each).
    Elsewhere: unchanged. Only the brake's own short-lived threads call it."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        pass


async def _in_own_thread(fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(*args)`` in a new thread and wait for it (a thread of its own: :func:`_urgent`
    must not leave a pooled executor thread real-time)."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not finished.done():
            finished.set_exception(error) if error is not None else finished.set_result(None)

    def run() -> None:
        error = None
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc
        loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="engine-brake-burst", daemon=True).start()
    await finished


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def relaying(app, rid: str, n: int = 1, most: int | None = None, settled_s: float = 0.0) -> Callable[[], bool]:
    """A ``hold_when`` condition: the router ``app`` relays at least ``n`` streams from replica
    ``rid`` that have each had a token and are not finished (``router.lifecycle.Flight``);
    with ``most``, each has relayed at most that many tokens; with ``settled_s``, the tokens
    relayed have not changed for that long (the router has caught up with the held engine: a
    loaded machine's API server can be hundreds of tokens behind, and a stream whose count was
    read mid-backlog was already generated to its end and finished before an update counted it)."""
    from router import keys

    seen = {"tokens": -1, "since": 0.0, "asked": 0.0}
    history: deque = deque(maxlen=12)

    def cond() -> bool:
        now = time.monotonic()
        gap, seen["asked"] = now - seen["asked"], now
        every = list(app[keys.LIFECYCLE].flights.get(rid, {}).values())
        flights = [f for f in every
                   if f.streaming and 0 < sum(f.tokens.values()) <= (most or 1 << 62) and not f.task.done()]
        observed = (round(now, 2), len(every), [sum(f.tokens.values()) for f in every if f.streaming])
        if not history or history[-1][1:] != observed[1:]:
            history.append(observed)
        if len(flights) < n:
            return False
        tokens = sum(sum(f.tokens.values()) for f in flights)
        if tokens != seen["tokens"] or gap > 0.1:  # new tokens, or the engine ran since the last look
            seen["tokens"], seen["since"] = tokens, now
        return now - seen["since"] >= settled_s
    cond.history = history  # type: ignore[attr-defined]
    return cond


def pause_answered(app, rid: str) -> Callable[[], bool]:
    """A ``hold_when`` condition: the weight update that router ``app`` runs is past replica
    ``rid``'s pause (its phase left ``queued`` and ``draining``), or no update runs there now.
    A held engine only queues the pause (vLLM pauses in the engine core): releasing it after a
    fixed sleep let a free engine finish the stream the update was meant to keep first."""
    from router import keys

    updater = app[keys.WEIGHT_UPDATER]

    def cond() -> bool:
        upd = updater.active
        rec = upd.replicas.get(rid) if upd is not None else None
        return rec is None or rec.phase not in ("queued", "draining")
    return cond


async def phase_reached(http, url: str, headers: dict, rid: str, phases: tuple[str, ...], timeout_s: float = 30) -> None:
    """Poll the router's ``GET /admin/weights`` until replica ``rid``'s update phase is one of ``phases``."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(url + "/admin/weights", headers=headers) as r:
            phase = (await r.json())["replicas"].get(rid, {}).get("phase")
        if phase in phases:
            return
        assert time.monotonic() < deadline, f"replica {rid} never reached {phases} (last {phase})"
        await asyncio.sleep(0.02)
