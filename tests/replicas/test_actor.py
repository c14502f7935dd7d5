"""VllmReplica's process lifecycle, with a stand-in server in place of vLLM (fast, no engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replicas import actor as actor_mod
from replicas.actor import VllmReplica
from replicas.config import ReplicaSetConfig
from tests.replicas.fake_server import FAKE_SERVER


def _fake(code: str):
    return lambda cfg, model_path, port, **kw: [sys.executable, "-c", code, "--port", str(port)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


async def test_start_info_stop(monkeypatch, tmp_path):
    monkeypatch.setattr(actor_mod, "build_command", _fake(FAKE_SERVER))
    replica = VllmReplica(ReplicaSetConfig(), 0, "unused", str(tmp_path))
    info = await replica.start()
    assert info.base_url.startswith("http://127.0.0.1:") and (info.block_size, info.num_gpu_blocks) == (32, 16384)
    assert await replica.alive() and _alive(info.pid)
    assert await replica.stop() == -signal.SIGTERM
    assert not _alive(info.pid) and not await replica.alive()
    assert "fake server up" in Path(info.log_path).read_text()


async def test_a_dying_server_raises_with_its_log_tail(monkeypatch, tmp_path):
    code = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)"
    monkeypatch.setattr(actor_mod, "build_command", _fake(code))
    replica = VllmReplica(ReplicaSetConfig(), 1, "unused", str(tmp_path))
    with pytest.raises(RuntimeError, match="replica 1 .* exited with code 3; last 40 lines") as err:
        await replica.start()
    assert "line 99" in str(err.value) and "line 60\n" in str(err.value) and "line 59\n" not in str(err.value)


async def test_startup_timeout_kills_the_process_group(monkeypatch, tmp_path):
    code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n" \
           "print('hung', flush=True)\ntime.sleep(600)"
    monkeypatch.setattr(actor_mod, "build_command", _fake(code))
    replica = VllmReplica(ReplicaSetConfig(startup_timeout_s=2), 0, "unused", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"not healthy after 2 s(.|\n)*hung"):
        await replica.start()
    time.sleep(0.2)
    out = subprocess.run(["pgrep", "-f", "time.sleep\\(600\\)"], capture_output=True, text=True).stdout.split()
    assert [p for p in out if _alive(int(p))] == []


def test_server_dies_with_its_owner(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the owning process (as Ray does on ray.kill) and the server goes too."""
    owner_code = (
        "import asyncio, sys\n"
        "from replicas import actor\n"
        f"actor.build_command = lambda cfg, m, port, **kw: [sys.executable, '-c', {FAKE_SERVER!r}, '--port', str(port)]\n"
        "from replicas.config import ReplicaSetConfig\n"
        f"r = actor.VllmReplica(ReplicaSetConfig(), 0, 'unused', {str(tmp_path)!r})\n"
        "info = asyncio.run(r.start())\n"
        "print(info.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    assert _alive(server_pid)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid)


def test_the_launcher_shim_moves_the_replica_onto_frontend_cpus():
    """The shim that execs vLLM applies ``frontend_cpus`` (here: exec a probe instead of vLLM)."""
    import json
    import subprocess
    import sys

    from replicas.actor import _DIE_WITH_PARENT
    from replicas.config import ReplicaSetConfig
    from replicas.server import FRONTEND_CPUS_ENV, build_env

    allowed = sorted(os.sched_getaffinity(0))
    cfg = ReplicaSetConfig(frontend_cpus=str(allowed[-1]))
    env = build_env(cfg, 0)
    assert env[FRONTEND_CPUS_ENV] == str(allowed[-1])
    probe = "import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ.get(%r)]))" % FRONTEND_CPUS_ENV
    out = subprocess.run([sys.executable, "-c", _DIE_WITH_PARENT, sys.executable, "-c", probe],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [[allowed[-1]], None]  # pinned, and the variable consumed
