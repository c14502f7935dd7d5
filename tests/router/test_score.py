"""``/v1/score`` through a router in front of the fake replica (``tests.router.edge_fixtures``):
the rows it returns, and its answer written before the lifecycle releases the job (issue 15)."""

from __future__ import annotations

import pytest
from aiohttp import web

from router import keys
from tests.router.edge_fixtures import edge_router, fake_replica, post


async def test_score_answers_before_its_job_is_released_and_no_update_can_take_it_back(monkeypatch):
    events: list = []
    async with fake_replica() as replica, edge_router(replica) as (url, app):
        life, core = app[keys.LIFECYCLE], app[keys.CORE]
        write_eof, finish = web.Response.write_eof, core.finish

        async def written(resp, data=b""):
            if "X-Rollout-Replica" not in resp.headers:  # the fake replica's own answer (same process)
                return await write_eof(resp, data)
            flights = [f for by_job in life.flights.values() for f in by_job.values()]
            events.append(("answering", [f.answering for f in flights]))  # a weight update leaves it alone
            await write_eof(resp, data)
            events.append("sent")  # aiohttp writes it again (a no-op) after the handler returns

        def finished(job, outcome, now):
            events.append(("finish", outcome))
            return finish(job, outcome, now)

        monkeypatch.setattr(web.Response, "write_eof", written)
        monkeypatch.setattr(core, "finish", finished)
        status, answer = await post(url, "/v1/score", json={"context": [5, 6, 7, 8], "responses": [[9, 10], [11]]})
    assert status == 200, answer
    assert [(r["index"], r["token_ids"], r["logprobs"]) for r in answer["results"]] == [
        (0, [9, 10], [-0.5, -0.5]), (1, [11], [-0.5])]
    assert (answer["replica"], answer["context_tokens"], answer["score_start"]) == ("replica-0", 4, 3)
    assert events[:3] == [("answering", [True]), "sent", ("finish", "ok")]


@pytest.mark.parametrize("usage", [{"prompt_tokens_details": [1]}, {"prompt_tokens_details": "x"}, [1], "x",
                                   {"prompt_tokens": "3", "prompt_tokens_details": {"cached_tokens": "2"}}])
def test_a_scoring_answers_usage_of_the_wrong_types_counts_nothing_cached(usage):
    """As a completion's (``UpstreamResult.cached_tokens``): no 500 from the router's own code."""
    from router.score import _rows
    payload = {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -0.5, "rank": 1}}]}], "usage": usage}
    row = _rows(payload, 1, [7], 0)
    assert (row["logprobs"], row["prompt_tokens"], row["cached_tokens"]) == ([-0.5], 2, 0)
