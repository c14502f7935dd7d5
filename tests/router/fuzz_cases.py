"""Hypothesis strategies for hostile requests to every router endpoint (tests/router/test_fuzz_vllm.py).

Each case is ``(method, path, headers, body bytes)``. Bodies mix well-formed requests (small
prompts, ``max_tokens`` <= 4, so the ones a replica runs stay cheap) with wrong types, extreme
numbers, lone surrogates, deep nesting, batches, unknown and vLLM-only fields; headers carry
routing keys, tenants and credentials of any text.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

VOCAB = 1130
WILD_TEXT = st.text(st.characters(codec=None), max_size=12)
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f"), max_size=300)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    WILD_TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(WILD_TEXT, inner, max_size=3)), max_leaves=8)
TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=48)
BAD_TOKENS = st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.booleans(), st.floats(), st.integers(2**40, 2**80)),
                      max_size=6)
SMALL_INT = st.one_of(st.integers(1, 4), st.integers(-3, 0), st.integers(5, 2**64), st.floats(0, 5), WILD_TEXT)
TEXT = st.one_of(st.text(max_size=40), st.just("caf\u00e9 \ud800"), st.just("x" * 300_000))
PROMPT = st.one_of(TOKENS, TEXT, st.lists(TOKENS, min_size=1, max_size=3), st.lists(TEXT, max_size=3), BAD_TOKENS,
                   JSON)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), JSON),
                                 "content": st.one_of(st.text(max_size=40), st.just([{"type": "text", "text": "hi"}]),
                                                      st.just([{"type": "image_url"}]), JSON)})
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JSON)
OPTIONAL = {
    "max_tokens": SMALL_INT, "n": SMALL_INT, "stream": st.one_of(st.booleans(), JSON),
    "temperature": st.one_of(st.floats(-2, 3), JSON), "top_p": st.floats(-1, 2), "logprobs": SMALL_INT,
    "session_id": st.one_of(WILD_TEXT, st.integers(), st.text(min_size=257, max_size=300), JSON),
    "group_id": st.one_of(WILD_TEXT, st.integers(), JSON), "weight_version": st.one_of(st.integers(-2, 2), JSON),
    "model": st.one_of(st.just("tiny-llama"), JSON), "stop": JSON, "seed": JSON,
    "add_special_tokens": st.one_of(st.booleans(), JSON), "truncate_prompt_tokens": st.one_of(st.none(), SMALL_INT),
}
CHAT_ONLY = {
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(st.sampled_from(["x", "tokenize", "enable_thinking"]),
                                                                 JSON, max_size=2), JSON),
    "tools": st.one_of(st.none(), JSON), "max_completion_tokens": SMALL_INT,
}
SCORE_FIELDS = {
    "context": st.one_of(TOKENS, TEXT, BAD_TOKENS, JSON), "responses": st.one_of(st.lists(TOKENS, min_size=1,
                                                                                          max_size=3),
                                                                                 st.lists(BAD_TOKENS, max_size=3), JSON),
    "top_logprobs": SMALL_INT, "messages": st.one_of(st.none(), MESSAGES),
}


@st.composite
def body_of(draw, required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    """A body with the required fields (each sometimes missing) and some optional ones."""
    body = {k: draw(v) for k, v in required.items() if draw(st.integers(0, 9))}
    chosen = draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True))
    body.update({k: draw(optional[k]) for k in chosen})
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = draw(st.integers(1, 4))  # a missing max_tokens would generate ~16k tokens
    if draw(st.integers(0, 9)) == 0:
        body[draw(WILD_TEXT)] = draw(JSON)
    return body


def _raw(body: Any, mangle: int) -> bytes:
    raw = json.dumps(body, ensure_ascii=True).encode()
    if mangle == 1:
        return raw[: len(raw) // 2]
    if mangle == 2:
        return b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    if mangle == 3:
        return b"\xff\xfe" + raw
    return raw


@st.composite
def headers(draw) -> dict[str, str]:
    names = ["X-Session-Id", "X-Group-Id", "X-Weight-Version", "X-Tenant-Id", "Authorization", "Content-Type"]
    chosen = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
    out = {name: draw(st.one_of(HEADER_TEXT, st.sampled_from(["1", "²", "-1", "Bearer x", "Bearer \u00e9\u00ff"])))
           for name in chosen}
    return {k: v.strip() or "0" for k, v in out.items()}


ENDPOINTS = {
    "/v1/completions": lambda: body_of({"prompt": PROMPT}, OPTIONAL),
    "/v1/chat/completions": lambda: body_of({"messages": MESSAGES}, {**OPTIONAL, **CHAT_ONLY}),
    "/v1/score": lambda: body_of({}, SCORE_FIELDS).map(lambda b: {k: v for k, v in b.items() if k != "max_tokens"}),
    "/admin/weights": lambda: JSON,
}
GETS = ["/v1/models", "/health", "/metrics", "/openapi.json", "/admin/weights"]


@st.composite
def case(draw) -> tuple[str, str, dict[str, str], bytes]:
    """One request: ``(method, path, headers, body)``."""
    if draw(st.integers(0, 9)) == 0:
        return "GET", draw(st.sampled_from(GETS)), draw(headers()), b""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    body = draw(ENDPOINTS[path]())
    mangle = draw(st.sampled_from([0] * 12 + [1, 2, 3]))
    return "POST", path, draw(headers()), _raw(body, mangle)
