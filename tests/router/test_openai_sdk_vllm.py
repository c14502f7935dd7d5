"""The OpenAI Python SDK, used unchanged, against the router on real vLLM-CPU (issue 9).

Completions with token IDs and ``extra_headers``, chat with ``stream=True``, ``n=4``, and routing
keys in ``extra_body``; the router's answers must be what the SDK parses, and route as promised.
"""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from router import keys
from tests.router.conftest import unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture
def client(router):
    return AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def test_completions_with_token_ids_and_extra_headers_stay_on_the_session_replica(client, router):
    prompt = unique_prompt(900, 200)
    first = await client.completions.with_raw_response.create(
        model="tiny-llama", prompt=prompt, max_tokens=3, extra_headers={"X-Session-Id": "sdk-s1"})
    replica = first.headers["X-Rollout-Replica"]
    parsed = first.parse()
    assert parsed.choices[0].text is not None and parsed.usage.prompt_tokens == len(prompt)
    second = await client.completions.with_raw_response.create(
        model="tiny-llama", prompt=prompt + [11, 12, 13], max_tokens=3, extra_headers={"X-Session-Id": "sdk-s1"})
    assert second.headers["X-Rollout-Replica"] == replica
    assert int(second.headers["X-Rollout-Expected-Cached-Tokens"]) == (len(prompt) // 32) * 32


async def test_chat_streams_and_n4_and_extra_body_routing_keys(client, router):
    messages = [{"role": "user", "content": "tell me about prefix caches " * 5}]
    stream = await client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=5,
                                                  stream=True, extra_body={"session_id": "sdk-chat"})
    chunks = [c async for c in stream]
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    four = await client.completions.create(model="tiny-llama", prompt=unique_prompt(901, 100), max_tokens=2, n=4,
                                           extra_body={"group_id": "sdk-g", "weight_version": 0})
    assert sorted(c.index for c in four.choices) == [0, 1, 2, 3]
    core = router.app[keys.CORE]
    assert core.registry.get("group", "sdk-g") is not None and core.registry.get("session", "sdk-chat") is not None


async def test_sdk_sees_a_clear_400_naming_the_field(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        await client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "max_tokens"
