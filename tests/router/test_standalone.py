"""``rollout-router serve`` on its own in front of existing vLLM servers (``replicas.urls``), in an
interpreter where torch, vLLM, transformers and Ray cannot be imported: the real CLI in a
subprocess, a fake vLLM server (``tests.router.fake_vllm``) on loopback, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.router.fake_vllm import FakeVllm, serving

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "rollout-router"
BLOCKED = ("torch", "vllm", "transformers", "ray")
BLOCKER = f'''
import sys
class _Blocked:
    """Any import of {BLOCKED} fails, as in an environment without them."""
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not installed here (tests.router.test_standalone)")
        return None
sys.meta_path.insert(0, _Blocked())
'''
PROMPT = [(7 * i + 3) % 900 + 8 for i in range(50)]
"""50 token IDs: a repeat can hit (50 - 1) // 16 = 3 blocks of 16 (48 tokens), not 32 or 64."""


@pytest.fixture
def no_vllm_env(tmp_path):
    """Environment for a subprocess in which torch, vLLM, transformers and Ray do not import."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def write_config(tmp_path: Path, urls: list[str]) -> Path:
    """A config that fronts ``urls`` and leaves ``replicas.block_size`` at its CPU default (32)."""
    path = tmp_path / "router.yaml"
    path.write_text("router:\n  port: 0\n  scrape_interval_s: 0.2\nreplicas:\n  urls:\n"
                    + "".join(f"    - {u}\n" for u in urls))
    return path


async def start(config: Path, env: dict) -> tuple[asyncio.subprocess.Process, str]:
    """Start the CLI; return it and the router's URL from its banner (60 s at most)."""
    proc = await asyncio.create_subprocess_exec(str(CLI), "serve", "--config", str(config), env=env, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if b"serving" not in line:
        proc.kill()
        _, err = await proc.communicate()
        pytest.fail(f"router did not start: {line!r} {err.decode()[-2000:]}")
    return proc, line.decode().split(" at ")[1].split()[0]


async def test_router_alone_serves_token_ids_with_the_servers_block_size(tmp_path, no_vllm_env):
    fake = FakeVllm(block_size=16, num_gpu_blocks=2000)
    async with serving(fake) as upstream:
        proc, url = await start(write_config(tmp_path, [upstream]), no_vllm_env)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                await check_serving(http, url, fake)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"rollout-router: stopped" in out
    assert b"Traceback" not in err, err.decode()[-2000:]


async def check_serving(http: aiohttp.ClientSession, url: str, fake: FakeVllm) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "session_id": "s-1"}
    expected = []
    for _ in range(2):
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            payload = await resp.json()
            expected.append(int(resp.headers["X-Rollout-Expected-Cached-Tokens"]))
        reported = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert expected == [0, (len(PROMPT) - 1) // 16 * 16] == [0, 48]  # 16-token blocks: 3 of them
    assert reported == 48  # what the fake's own prefix cache says
    assert fake.bodies[-1]["prompt"] == PROMPT and fake.bodies[-1]["model"] == "fake-gpu-model"  # /v1/models
    for path, text, param in [("/v1/completions", {"prompt": "hello there"}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                              ("/v1/score", {"context": "some text", "responses": [[9, 10]]}, "context")]:
        async with http.post(url + path, json={**text, "max_tokens": 1}) as resp:
            error = (await resp.json())["error"]
            assert (resp.status, error["param"]) == (400, param), error
            assert "text prompts need a tokenizer: set router.tokenizer" in error["message"]
    sent = len(fake.bodies)
    async with http.post(url + "/v1/completions", json={"prompt": PROMPT[:10] + [fake.vocab_size + 5]}) as resp:
        error = (await resp.json())["error"]  # no vocabulary here: the replica's 400, naming our field
        assert (resp.status, error["param"]) == (400, "prompt"), error
        assert f"Token id {fake.vocab_size + 5} is out of vocabulary" in error["message"]
    assert len(fake.bodies) == sent + 1
    async with http.get(url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["fake-gpu-model"]


async def test_servers_that_disagree_on_block_size_are_one_line_refused(tmp_path, no_vllm_env):
    async with serving(FakeVllm(block_size=16)) as a, serving(FakeVllm(block_size=32)) as b:
        proc = await asyncio.create_subprocess_exec(
            str(CLI), "serve", "--config", str(write_config(tmp_path, [a, b])), env=no_vllm_env, cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    # a progress line, then the one line that says why (no traceback)
    assert err.decode().splitlines() == [
        "rollout-router: checking 2 vLLM server(s) ...",
        f"rollout-router: cannot start: replicas.urls[1] {b} has KV block size 32 but replica-0 ({a}) has 16: every "
        "replica behind one router must use the same block size"]


async def test_launching_replicas_without_ray_and_vllm_is_one_line_refused(tmp_path, no_vllm_env):
    # a router-only install (`pip install .`, Ray and vLLM are the [cpu]/[gpu] extras' only) asked
    # to launch replicas: one line saying what to install, not an import traceback
    config = tmp_path / "launch.yaml"
    config.write_text("replicas:\n  num_replicas: 1\n")
    proc = await asyncio.create_subprocess_exec(
        str(CLI), "serve", "--config", str(config), "--port", "0", env=no_vllm_env, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2, err.decode()[-2000:]
    assert err.decode().endswith("rollout-router: cannot start: launching replicas needs Ray and vLLM: pip install "
                                 "'.[cpu]' or '.[gpu]' (or list existing servers in replicas.urls)\n"), err.decode()[-2000:]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_busy_poll_spends_cpu_after_requests_and_none_once_they_stop(tmp_path, no_vllm_env):
    # router.busy_poll_ms: after a request the router's loop polls (a CPU busy) for the window,
    # then sleeps again; a router without it sleeps as soon as it waits. A request whose API key
    # the edge refuses starts no polling (an attacker kept a core busy with keyless requests)
    window_s = 0.6
    config = tmp_path / "router.yaml"
    fake = FakeVllm(block_size=16)
    async with serving(fake) as upstream:
        config.write_text(f"router:\n  port: 0\n  busy_poll_ms: {window_s * 1e3}\n  api_keys: {{sk-test: null}}\n"
                          f"replicas:\n  urls: [{upstream}]\n")
        proc, url = await start(config, no_vllm_env)
        body = {"prompt": PROMPT, "max_tokens": 1}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                await asyncio.sleep(1.0)  # started; no request yet
                for _ in range(3):
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 401
                before = cpu_s(proc.pid)
                await asyncio.sleep(0.4)
                idle = cpu_s(proc.pid) - before
                sent_at = time.monotonic()
                async with http.post(url + "/v1/completions", json=body,
                                     headers={"Authorization": "Bearer sk-test"}) as resp:
                    assert resp.status == 200, await resp.text()
                before = cpu_s(proc.pid)
                await asyncio.sleep(0.4)  # inside the window the request's end opened
                polling = cpu_s(proc.pid) - before
                async with http.get(url + "/metrics") as resp:  # counted up to the scrape, not the window's end
                    during = metric(await resp.text(), "rollout_router_busy_poll_seconds_total")
                scraped_after = time.monotonic() - sent_at
                await asyncio.sleep(window_s)
                before = cpu_s(proc.pid)
                await asyncio.sleep(0.4)
                after = cpu_s(proc.pid) - before
                async with http.get(url + "/metrics") as resp:
                    counted = metric(await resp.text(), "rollout_router_busy_poll_seconds_total")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert idle < 0.1 and after < 0.1, (idle, after)  # a sleeping loop: the 1 s scrapes cost a few ms
    assert polling >= 0.2, polling  # about 0.4 s when it has a CPU to itself
    # counted up to the scrape: at least the 0.4 s slept, at most the time since the request was
    # sent (a loaded host can delay this client past the window's end)
    assert 0.35 <= during <= scraped_after + 0.05, (during, scraped_after)
    assert window_s - 0.05 <= counted < window_s + 0.5, counted  # the window after the request's end


def metric(page: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` on a Prometheus text ``page``."""
    return next(float(line.split()[-1]) for line in page.splitlines() if line.startswith(name + " "))


def stall_config(tmp_path: Path, urls: list[str], **policy: float) -> Path:
    """A router config over ``urls`` scraping every 0.2 s with the stall rule's ``policy`` settings."""
    config = tmp_path / "router.yaml"
    settings = "".join(f"  {k}: {v}\n" for k, v in policy.items())
    config.write_text(f"router:\n  port: 0\n  scrape_interval_s: 0.2\npolicy:\n{settings}"
                      f"replicas:\n  urls: [{', '.join(urls)}]\n")
    return config


async def test_a_stalled_engine_is_taken_out_and_its_request_answered_by_another_replica(tmp_path, no_vllm_env):
    # a hung engine behind an API server that still answers /health and /metrics (vLLM's health
    # check reports only a dead engine): the scrapes show it holding a request and finishing no
    # token, so after policy.stall_timeout_s it leaves rotation and the request in flight there
    # runs on the other replica; once its counters move again it is back
    fakes = [FakeVllm(block_size=16), FakeVllm(block_size=16)]
    async with serving(fakes[0]) as url0, serving(fakes[1]) as url1:
        config = stall_config(tmp_path, [url0, url1], stall_timeout_s=1.5, stall_restart_after=1)
        proc, url = await start(config, no_vllm_env)
        body, headers = {"prompt": PROMPT, "max_tokens": 1}, {"X-Session-Id": "agent-1"}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    pinned = resp.headers["X-Rollout-Replica"]
                by_id = {"replica-0": fakes[0], "replica-1": fakes[1]}
                stalled, other = by_id[pinned], next(f for r, f in by_id.items() if r != pinned)
                stalled.stall()
                answered_before = len(other.bodies)
                t0 = asyncio.get_running_loop().time()
                async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    took = asyncio.get_running_loop().time() - t0
                    replica = resp.headers["X-Rollout-Replica"]
                async with http.get(url + "/metrics") as resp:
                    page = await resp.text()
                    out = gauge(page, "rollout_router_replica_healthy", pinned)
                    stalls = gauge(page, "rollout_router_replica_stalls_total", pinned)
                async with http.get(url + "/health") as resp:  # says why it is out
                    shown = {r["replica"]: (r["healthy"], r["stalled"], r["stalls"]) for r in (await resp.json())["replicas"]}
                stalled.resume()  # its held request finishes: the counters move
                for _ in range(50):
                    await asyncio.sleep(0.1)
                    async with http.get(url + "/metrics") as resp:
                        back = gauge(await resp.text(), "rollout_router_replica_healthy", pinned)
                    if back == 1:
                        break
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert stalled.bodies[-1]["prompt"] == PROMPT  # it was sent to the stalled replica first
    assert replica != pinned and len(other.bodies) == answered_before + 1  # then answered by the other
    assert 1.5 <= took < 15, took  # not before the stall timeout; not router.request_timeout_s (600 s)
    assert shown == {pinned: (False, True, 1), replica: (True, False, 0)}, shown
    assert out == 0 and back == 1 and stalls == 1, (out, back, stalls)
    assert "stalled" in err.decode()  # said once in the log
    # due for a restart at its first stall here (stall_restart_after: 1), which a urls server cannot
    # get from this router: said once (every scrape round while it stalls saw it due), not silently
    assert err.decode().count("this router cannot restart it") == 1, err.decode()[-3000:]


async def test_an_engine_hung_while_idle_is_found_by_a_probe_before_any_client_request_waits_on_it(tmp_path, no_vllm_env):
    # without the probe an engine hung while idle looks healthy (it answers /health and /metrics,
    # which stand still as an idle engine's do) until a client's request is sent there and waits
    # out policy.stall_timeout_s; the router's probe is that request, so no client waits
    fakes = [FakeVllm(block_size=16), FakeVllm(block_size=16)]
    async with serving(fakes[0]) as url0, serving(fakes[1]) as url1:
        config = stall_config(tmp_path, [url0, url1], stall_timeout_s=1.5, stall_probe_after_s=1)
        fakes[0].stall()  # hung from the start: it never answers a completion
        proc, url = await start(config, no_vllm_env)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                deadline = time.monotonic() + 20
                while True:  # probed after 1 s idle, stalled 1.5 s later
                    async with http.get(url + "/health") as resp:
                        rows = {r["replica"]: r for r in (await resp.json())["replicas"]}
                    if rows["replica-0"]["stalled"] or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                assert rows["replica-0"]["stalled"] and not rows["replica-1"]["stalled"], rows
                assert rows["replica-0"]["probing"], rows  # the probe still hangs there
                assert [b["prompt"] for b in fakes[0].bodies] == [[0]] and fakes[0].bodies[0]["max_tokens"] == 1
                took = []
                for i in range(4):  # new sessions: none is sent to the hung engine, none waits
                    t0 = time.monotonic()
                    headers = {"X-Session-Id": f"agent-{i}"}
                    async with http.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                                         headers=headers) as resp:
                        assert resp.status == 200 and resp.headers["X-Rollout-Replica"] == "replica-1"
                    took.append(time.monotonic() - t0)
                fakes[0].resume()  # the probe is answered: tokens move, it is back
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    async with http.get(url + "/metrics") as resp:
                        page = await resp.text()
                    if gauge(page, "rollout_router_replica_healthy", "replica-0") == 1:
                        break
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert max(took) < 1.0, took  # not the stall timeout
    assert gauge(page, "rollout_router_replica_healthy", "replica-0") == 1
    assert 'rollout_router_replica_probes_total{outcome="ok",replica="replica-0"} 1.0' in page, page[-3000:]
    assert all(b["prompt"] == [0] for b in fakes[0].bodies)  # probes alone (another may follow 1 s after)


def gauge(page: str, name: str, replica: str) -> float:
    """The value of ``name{replica="..."}`` on a Prometheus text ``page``."""
    prefix = f'{name}{{replica="{replica}"}} '
    return next(float(line[len(prefix):]) for line in page.splitlines() if line.startswith(prefix))


async def test_an_update_through_servers_without_dev_mode_fails_and_leaves_them_serving(tmp_path, no_vllm_env):
    # vLLM started without VLLM_SERVER_DEV_MODE=1 has no /pause (404): the update fails naming
    # the missing mode, and every replica stays in rotation on its weights (a fresh user's fleet
    # went out of service for good after one update)
    fakes = [FakeVllm(block_size=16, dev_mode=False), FakeVllm(block_size=16, dev_mode=False)]
    admin = {"Authorization": "Bearer admin-secret"}
    async with serving(fakes[0]) as url0, serving(fakes[1]) as url1:
        config = tmp_path / "router.yaml"
        config.write_text(f"router:\n  port: 0\n  admin_token: admin-secret\n"
                          f"replicas:\n  urls: [{url0}, {url1}]\n")
        proc, url = await start(config, no_vllm_env)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                update = {"version": 1, "weights_path": "/ckpt/1", "policy": "salt", "mode": "rolling"}
                async with http.post(url + "/admin/weights", json=update, headers=admin) as resp:
                    report = await resp.json()
                async with http.get(url + "/admin/replicas", headers=admin) as resp:
                    replicas = (await resp.json())["replicas"]
                statuses = []
                for i in range(4):
                    async with http.post(url + "/v1/completions", json={"prompt": PROMPT[i:], "max_tokens": 1}) as resp:
                        statuses.append(resp.status)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "VLLM_SERVER_DEV_MODE=1" in str(report), report
    assert [r["in_rotation"] for r in replicas] == [True, True], replicas
    assert statuses == [200] * 4, statuses
