"""bench.h2h on loopback: the simulated replicas' HTTP API, the ideal count, a workload driven over
HTTP, routing-key headers and the profile summary. No Rust router here: vllm-router and
sglang-router live in a separate venv (.venv-h2h) that CI does not install; `python -m bench.h2h`
runs them."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import aiohttp
import pytest

from bench.h2h.drive import IdealCounter, fold, run_workload
from bench.h2h.profile import top_frames
from bench.h2h.replica import FAST_COST, ZERO_COST, SimReplica
from bench.h2h.routers import RouterSpec
from bench.h2h.server import serve, spell_ids
from bench.sim.engine import EngineConfig
from bench.sim.seqhash import SequenceHashes
from bench.sim.workloads import WorkloadConfig
from replicas.metrics import parse_vllm_metrics

BS = 16


async def _replicas(n: int, cost, blocks: int = 2048) -> list[str]:
    cfg = EngineConfig(num_blocks=blocks, block_size=BS, cost=cost)
    hashes = SequenceHashes(BS)
    return await serve([SimReplica(f"t{i}", cfg, hashes) for i in range(n)], None, "sim-model")


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_replica_counts_cache_hits_and_serves_vllm_metrics():
    async def go():
        (url,) = await _replicas(1, FAST_COST)
        prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
        async with aiohttp.ClientSession() as http:
            first = await _post(http, f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 4})
            again = await _post(http, f"{url}/v1/completions", {"prompt": spell_ids(prompt), "max_tokens": 4})
            salted = await _post(http, f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 4, "cache_salt": "v2"})
            async with http.get(f"{url}/metrics") as r:
                m = parse_vllm_metrics(await r.text())
            async with http.post(f"{url}/v1/completions", json={"prompt": []}) as r:
                bad = (r.status, await r.json())
        return first, again, salted, m, bad

    first, again, salted, m, bad = asyncio.run(go())
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS  # (50 - 1) // 16 blocks
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another salt, other hashes
    assert (m.block_size, m.num_gpu_blocks, m.prompt_tokens, m.prefix_cache_hits) == (BS, 2048, 150, 48)
    assert (m.generation_tokens, m.num_running, m.num_waiting) == (12, 0, 0)
    assert bad[0] == 400 and bad[1]["error"]["param"] == "prompt"


def test_ideal_counts_each_prompt_block_once():
    ideal = IdealCounter(BS)
    a = list(range(10, 60))  # 50 tokens
    ideal.add("s", a)
    ideal.add("s2", a[:40] + list(range(500, 510)))  # shares 2 full blocks (a key's tokens only grow)
    ideal.add("x", a)  # hit capped at (50 - 1) // 16 = 3 blocks
    assert ideal.prefill == 50 + (50 - 32) + (50 - 48)
    assert ideal.prompt == 150


def test_workload_through_one_replica_prefills_exactly_the_ideal():
    """One replica with room for everything: what it prefills is the shared-cache ideal."""
    async def go():
        (url,) = await _replicas(1, ZERO_COST, blocks=1 << 16)
        cfg = WorkloadConfig(groups_per_replica=2, grpo_prompt=(100, 300), grpo_output=(4, 8),
                             sessions_per_replica=2, first_prompt=(50, 150), observation=(10, 40), reply=(4, 8),
                             tool_pause_s=0.002)
        spec = RouterSpec("direct", "vllm", "none", "x-session-id")
        run = await run_workload(spec, url, cfg, {"grpo", "agent"}, 1, 96, 3, BS, 60.0)
        async with aiohttp.ClientSession() as http, http.get(f"{url}/sim/stats") as r:
            return run, await r.json()

    run, stats = asyncio.run(go())
    assert run["errors"] == {} and run["requests_ok"] == stats["requests"] > 48
    assert stats["prefilled_tokens"] == run["ideal_prefilled_tokens"]
    assert stats["prompt_tokens"] == run["prompt_tokens"]


def test_fold_keeps_ids_in_the_tiny_vocabulary_and_prefixes_equal():
    ids = [0, 7, 8, 1099, 1100, 31999]
    assert fold(ids) == [8 + 0, 8 + 7, 8 + 8, 8 + 1099 % 1092, 8 + 1100 % 1092, 8 + 31999 % 1092]
    assert all(8 <= t < 1100 for t in fold(list(range(40000))))


@pytest.mark.parametrize("spec, sid, gid, end, want", [
    (RouterSpec("ours", "ours", "default", None), "s1", None, True, {"X-Session-Id": "s1", "X-Session-End": "true"}),
    (RouterSpec("ours", "ours", "default", None), None, "g1", False, {"X-Group-Id": "g1"}),
    (RouterSpec("v", "vllm", "consistent_hash", "x-session-id"), None, "g1", False, {"x-session-id": "g1"}),
    (RouterSpec("s", "sglang", "consistent_hashing", "x-smg-routing-key", True), "s2", None, True,
     {"x-smg-routing-key": "s2"}),
    (RouterSpec("r", "vllm", "round_robin", None), "s2", "g", False, {}),
])
def test_routing_key_headers(spec, sid, gid, end, want):
    assert spec.headers(sid, gid, end) == want


def test_top_frames_shares():
    raw = "main;a;b 6\nmain;a 3\nmain;c 1\n"
    got = top_frames(raw, top=3)
    assert got["samples"] == 10
    assert got["self"] == [("b", 0.6), ("a", 0.3), ("c", 0.1)]
    assert got["total"][0] == ("main", 1.0) and ("a", 0.9) in got["total"]


def test_ab_measures_a_checkout_beside_the_pass_through_floor():
    """``bench.h2h.ab`` on this checkout: its router and the five floors each answered every prompt
    (a non-200 raises; the token-ID and decision-core floors close the connection on a prompt they
    cannot read or admit) and their processes spent CPU on them."""
    from bench.h2h.ab import run
    from bench.h2h.routers import ROOT

    result = asyncio.run(run([ROOT], requests=300, tokens=300, seed=1, warmup=3))  # CPU is read in 10 ms ticks: a bare floor spends ~0.1 ms a request
    assert list(result) == [f"1: {ROOT}", "aiohttp pass-through", "aiohttp server + lean client",
                            "bare uvloop + httptools pass-through", "bare + token-ID read",
                            "bare + token-ID read + decision core"]
    for row in result.values():
        assert row["cpu_ms_per_request"] > 0 and row["direct_p50_ms"] > 0


def test_ab_turns_extend_each_session_prompt():
    """``--turns K``: K prompts per session, each the one before plus new IDs, the last about
    ``tokens``; ``--turns 1``: every prompt new, ``tokens`` long."""
    import itertools

    import numpy as np

    from bench.h2h.ab import turn_prompts

    got = list(itertools.islice(turn_prompts(np.random.default_rng(0), 400, 4), 8))
    assert [s for s, _ in got] == ["ab-0"] * 4 + ["ab-1"] * 4
    for (_, before), (_, after) in zip(got[:3], got[1:4]):
        assert after[:len(before)] == before and len(after) == len(before) + 33
    assert [len(ids) for _, ids in got[:4]] == [300, 333, 366, 399]
    assert got[4][1][:300] != got[0][1][:300]  # a new session, a new prompt
    new = list(itertools.islice(turn_prompts(np.random.default_rng(0), 400, 1), 3))
    assert [s for s, _ in new] == ["ab-0", "ab-1", "ab-2"] and all(len(ids) == 400 for _, ids in new)


def test_ab_with_turns_routes_each_session_by_its_header():
    """``run`` with ``turns``: the checkout and the floors answer every turn, routing headers and
    all (a non-200 raises), and the checkout's router spent CPU on them."""
    from bench.h2h.ab import run
    from bench.h2h.routers import ROOT

    result = asyncio.run(run([ROOT], requests=40, tokens=400, seed=2, warmup=2, turns=4))
    assert result[f"1: {ROOT}"]["cpu_ms_per_request"] > 0


def test_ab_runs_a_checkout_with_its_own_settings():
    """``PATH@section.key=value``: that checkout's router runs with those settings (here a body
    limit its prompts pass: it answers 413, which ``run`` raises), the same checkout without
    them beside it."""
    from pathlib import Path

    from bench.h2h.ab import checkout, run
    from bench.h2h.routers import ROOT

    assert checkout("/a/b") == Path("/a/b")
    assert checkout("/x@y/z") == Path("/x@y/z")  # an @ without a setting after it: part of the path
    assert checkout("/a@router.busy_poll_ms=50,policy.max_queue=7") == (
        Path("/a"), {"router.busy_poll_ms": 50, "policy.max_queue": 7})
    assert checkout("/p@q@router.x=1") == (Path("/p@q"), {"router.x": 1})
    assert checkout(f"/a@python={sys.executable},router.x=1") == (Path("/a"), {"python": sys.executable, "router.x": 1})
    for bad, why in [("/a@busy_poll_ms=1", "settings are section.key=value, got 'busy_poll_ms=1'"),
                     ("/a@router.port=1", "router.port is set by ab itself"),
                     ("/a@router.x=[1", "the value of router.x is not YAML"),
                     ("/a@python=/no/such/python", "python='/no/such/python' is not an executable file")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
            checkout(bad)
    with pytest.raises(RuntimeError, match=r"2: .* router.max_body_bytes=1000 answered 413"):
        asyncio.run(run([ROOT, (ROOT, {"router.max_body_bytes": 1000})], requests=5, tokens=400, seed=3, warmup=1))
    # a setting the router refuses: its own one-line reason, from its log
    with pytest.raises(RuntimeError, match=r"router.busy_poll_ms=-1 exited with 2\n.*router.busy_poll_ms: must be in"):
        asyncio.run(run([(ROOT, {"router.busy_poll_ms": -1})], requests=5, tokens=400, seed=3, warmup=1))


def test_ab_takes_only_rust_routers_that_read_token_ids(capsys):
    """``--rust`` names vllm-router's policies; sglang-router (text prompts only) or a typo is a
    usage error before anything starts."""
    from bench.h2h.ab import main
    from bench.h2h.routers import ROOT

    for name in ("sglang-router round_robin", "vllm-router nope"):
        with pytest.raises(SystemExit) as exc:
            main([str(ROOT), "--rust", name])
        assert exc.value.code == 2 and "vllm-router round_robin" in capsys.readouterr().err
    for bad in (["--requests", "0"], ["--seed", "-1"], ["--turns", "0"], ["--turns", "5", "--tokens", "10"]):
        with pytest.raises(SystemExit) as exc:  # a usage error, not a traceback (a fresh user's finding)
            main([str(ROOT), *bad])
        assert exc.value.code == 2 and bad[0] in capsys.readouterr().err


@pytest.mark.parametrize("refusals, ok, retries, errors", [(2, 1, 2, {}), (3, 0, 2, {"429": 1}), (0, 1, 0, {})])
def test_the_drive_retries_429_after_retry_after_as_the_openai_sdk_does(refusals, ok, retries, errors):
    """A router answering 429 (Retry-After: 0) ``refusals`` times, then 200: the drive retries
    twice, like the SDK's default ``max_retries``, then counts the 429 as an error."""
    from aiohttp import web

    from bench.h2h.drive import HttpSink
    from bench.sim.workloads import Item
    from tests.loopback import app_on_loopback

    async def go():
        seen = []

        async def completions(request: web.Request) -> web.Response:
            seen.append(await request.json())
            if len(seen) <= refusals:
                return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "0"})
            return web.json_response({"choices": [{"text": "x"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with app_on_loopback(app) as url, aiohttp.ClientSession() as http:
            sink = HttpSink(RouterSpec("direct", "vllm", "none", None), url, http, IdealCounter(BS))
            sink.issue(Item(1, "agent", "generate", list(range(20, 60)), "k", [1], [None]), 0.0)
            await asyncio.wait_for(sink.done.wait(), 30)
        return sink, seen

    sink, seen = asyncio.run(go())
    assert (sink.ok, sink.retries, sink.errors) == (ok, retries, errors)
    assert len(seen) == min(refusals, 2) + 1 and all(body == seen[0] for body in seen)


def test_bare_core_floor_decides_each_token_id_prompt():
    """``bench.h2h.bare --core`` runs the decision core on every prompt it forwards: after two
    requests the core's prefix index holds the first prompt's blocks (hashed here independently)
    on its one replica, both jobs finished (nothing in flight); a text prompt is not forwarded."""
    from aiohttp import web

    from bench.h2h.bare import serve as serve_bare
    from bench.h2h.routers import free_port
    from cache_policy.config import PolicyConfig
    from cache_policy.core import DecisionCore
    from cache_policy.hashing import block_hashes

    async def main():
        seen = []

        async def upstream(request):
            seen.append(await request.json())
            return web.json_response({"choices": [{"text": "x"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", upstream)
        runner = web.AppRunner(app)
        await runner.setup()
        up_port, port = free_port(), free_port()
        await web.TCPSite(runner, "127.0.0.1", up_port).start()
        core = DecisionCore(PolicyConfig())
        core.add_replica("r0", block_size=16, num_gpu_blocks=64)
        server = asyncio.create_task(serve_bare(port, f"http://127.0.0.1:{up_port}", "core", core))
        await asyncio.sleep(0.2)
        ids = list(range(100, 164))  # 4 blocks
        try:
            async with aiohttp.ClientSession() as http:
                for prompt in (ids, ids + [7] * 16):
                    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt}) as r:
                        assert r.status == 200 and await r.json() == {"choices": [{"text": "x"}]}
                with pytest.raises(aiohttp.ClientError):
                    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "text"}) as r:
                        await r.read()
            await asyncio.sleep(0.05)
            assert [b["prompt"] for b in seen] == [ids, ids + [7] * 16]
            core.settle()
            # the default policy salts every request with the loaded version (0): "rr:v0"
            assert core.prefix_index().match(tuple(block_hashes(ids, 16, "rr:v0")), touch=False) == {"r0": 4}
            assert core.in_flight("r0") == 0
        finally:
            server.cancel()
            await runner.cleanup()

    asyncio.run(main())


def test_ab_builds_each_checkouts_extension_or_names_the_checkout(tmp_path):
    """A fresh worktree has no built C extension: ``ab`` builds it (a no-op when up to date, as
    here) and checks the router would load it; a folder it cannot build in is named."""
    from bench.h2h.ab import build_native
    from bench.h2h.routers import ROOT

    build_native(ROOT)
    with pytest.raises(RuntimeError, match=re.escape(f"{tmp_path}: setup.py -q failed (the C extension)")):
        build_native(tmp_path)


def test_an_ours_spec_with_settings_runs_with_them_and_only_in_the_latency_run(tmp_path):
    """``bench.h2h``'s "ours busy_poll_ms=50": its config carries the setting (and the replicas'
    URLs); like the floor it is in the latency run only (polling changes no routing decision)."""
    import yaml

    from bench.h2h.routers import ALL, command

    spec = next(s for s in ALL if s.name == "ours busy_poll_ms=50")
    argv = command(spec, ["http://127.0.0.1:9"], 5, tmp_path, tmp_path)
    cfg = yaml.safe_load(open(argv[argv.index("--config") + 1]))
    assert cfg["router"] == {"busy_poll_ms": 50} and cfg["replicas"]["urls"] == ["http://127.0.0.1:9"]
    assert [s.name for s in ALL if not s.workloads] == ["ours busy_poll_ms=50", "aiohttp pass-through"]


def test_neighbours_times_cpu_bound_work_beside_each_setting_and_a_polling_router_spends_its_gaps():
    """``bench.h2h.neighbours``: the neighbours ran for every setting and without a router; each
    router answered the client (a non-200 raises) while they ran; the router polling 50 ms after
    each request spent the client's 10 ms gaps running (several ms of CPU per request), the one
    not polling well under one."""
    from bench.h2h.neighbours import main

    result = main(["--poll-ms", "0", "50", "--neighbours", "1", "--loop", "6000000", "--rounds", "1", "--tokens", "300"])
    assert list(result) == ["no router", "busy_poll_ms 0", "busy_poll_ms 50"]
    assert all(r[0]["neighbour_s"] > 0 for r in result.values())
    quiet, polling = result["busy_poll_ms 0"][0], result["busy_poll_ms 50"][0]
    assert quiet["requests"] >= 3 and polling["requests"] >= 3, (quiet, polling)
    assert quiet["cpu_ms_per_request"] < 1.5 < 4 < polling["cpu_ms_per_request"], (quiet, polling)
