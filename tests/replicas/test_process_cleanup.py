"""No process of a replica outlives its server: the die-with-parent chain and the group reaper.

Real processes and signals, a stand-in server in place of vLLM (fast): the stand-in starts a
child the way vLLM starts its engine core (multiprocessing ``spawn``), and that child starts a
grandchild the same way (the engine core's worker).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from replicas import actor as actor_mod
from replicas.actor import VllmReplica
from replicas.config import ReplicaSetConfig
from replicas.procs import group_members
from tests.replicas.fake_server import FAKE_SERVER

# The stand-in server, plus an "engine core" and a "worker" below it, started like vLLM's.
ENGINE_TREE = """
import multiprocessing as mp, os, sys, time
def worker():
    time.sleep(600)
def engine_core():
    mp.get_context("spawn").Process(target=worker).start()
    time.sleep(600)
if __name__ == "__main__":
    mp.get_context("spawn").Process(target=engine_core).start()
    exec(compile(open(sys.argv[1]).read(), "fake_server", "exec"))
"""

# The stand-in server with a child that is not Python (no sitecustomize runs in it).
SHELL_CHILD = "import subprocess\nsubprocess.Popen(['sleep', '600'])\n" + FAKE_SERVER


def _launch_with(monkeypatch, tmp_path, code: str) -> None:
    script = tmp_path / "server.py"
    script.write_text(code)
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    monkeypatch.setattr(actor_mod, "build_command", lambda cfg, model, port, **kw:
                        [sys.executable, str(script), str(fake), "--port", str(port)])


async def _wait_members(pgid: int, count: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        members = group_members(pgid)
        if len(members) == count or time.monotonic() > deadline:
            return members
        await asyncio.sleep(0.1)


async def test_sigkill_of_the_server_takes_engine_core_and_worker_down_by_itself(monkeypatch, tmp_path):
    _launch_with(monkeypatch, tmp_path, ENGINE_TREE)
    replica = VllmReplica(ReplicaSetConfig(), 0, "unused", str(tmp_path))
    info = await replica.start()
    try:
        tree = await _wait_members(info.pid, 4, 30)  # server, resource tracker, engine core, worker
        assert len(tree) == 4 and info.pid in tree
        os.kill(info.pid, signal.SIGKILL)
        # nobody reaps the group here: PR_SET_PDEATHSIG alone must empty it
        assert await _wait_members(info.pid, 0, 10) == []
    finally:
        await replica.stop()


async def test_alive_reaps_what_the_death_signal_cannot_reach(monkeypatch, tmp_path):
    _launch_with(monkeypatch, tmp_path, SHELL_CHILD)
    replica = VllmReplica(ReplicaSetConfig(), 0, "unused", str(tmp_path))
    info = await replica.start()
    try:
        assert len(await _wait_members(info.pid, 2, 10)) == 2  # server and `sleep 600`
        os.kill(info.pid, signal.SIGKILL)
        await asyncio.sleep(1.0)
        assert len(group_members(info.pid)) == 1  # the orphaned `sleep` survives its parent...
        assert not await replica.alive()  # ...until the replica notices its server is gone
        assert await _wait_members(info.pid, 0, 5) == []
    finally:
        await replica.stop()
