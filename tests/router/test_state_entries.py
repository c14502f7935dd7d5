"""``rollout_router_state_entries``: a served router publishes what each part of its state holds
after every scrape round, and once its traffic is over (answered, refused, or clients gone
mid-request) nothing per request is left: no flight, waiter, rerun, ticket, queued job or held
block, and no per-replica entry of the lifecycle's flights."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from router import keys
from tests.router.edge_fixtures import edge_router, fake_replica

PER_REQUEST = ("flights", "waiters", "reruns", "tickets", "queued", "jobs_queued", "held_blocks", "unheld")


async def _entries(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {m[1]: float(m[2]) for m in re.finditer(r'^rollout_router_state_entries\{part="([a-z_]+)"\} (\S+)$',
                                                   text, re.M)}


@pytest.mark.asyncio
async def test_state_entries_are_published_and_nothing_per_request_is_left_after_traffic():
    async with fake_replica() as replica, edge_router(replica, scrape_interval_s=0.1) as (url, app):
        async with aiohttp.ClientSession() as http:
            async def complete(k: int, **extra) -> int:
                body = {"prompt": list(range(100 + k, 164 + k)), "max_tokens": 4, **extra}
                async with http.post(url + "/v1/completions", json=body,
                                     headers={"X-Session-Id": f"s{k % 3}"}) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(complete(k) for k in range(12)),
                                            *(complete(k, temperature=-1) for k in range(12, 15)))
            assert statuses == [200] * 12 + [400] * 3
            slow = [asyncio.create_task(complete(k, x_sleep_s=2)) for k in range(15, 19)]
            await asyncio.sleep(0.3)  # on their way to the replica: then their clients leave
            during = app[keys.LIFECYCLE].state_sizes()
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            assert during["flights"] == 4
            for _ in range(100):  # the router sees each client go, then a scrape round publishes
                entries = await _entries(http, url)
                if entries and all(entries.get(part) == 0 for part in PER_REQUEST):
                    break
                await asyncio.sleep(0.05)
            assert {part: entries.get(part) for part in PER_REQUEST} == dict.fromkeys(PER_REQUEST, 0.0)
            assert entries["replicas"] == 1 and entries["keys"] == 3  # the sessions s0, s1, s2
            assert app[keys.LIFECYCLE].flights == {}  # not even an empty entry for the replica
