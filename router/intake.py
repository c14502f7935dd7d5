"""From an HTTP request to validated, tokenized work: everything checked before admission.

Order, cheapest first: the body (size, time, JSON safety: ``router.edge``, ``router.body``),
the fields and their caps (``router.parse``: ``n``, K, key lengths, a character bound on text),
then the tokens: IDs inside the vocabulary, the prompt shorter than ``max_model_len``, and the
output asked for (``max_tokens`` / ``max_completion_tokens``) no more than what is left. A request
that cannot fit is a 400 naming the field here, never a wait in the admission queue followed by
the replica's refusal.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router import keys
from router.body import load_json_object, load_json_split
from router.edge import body_of, tenant_of
from router.errors import BadRequest
from router.parse import Limits, ParsedRequest, ScoreRequest, parse_chat, parse_completion, parse_score


PROMPT_FIELD = "prompt"
"""The ``/v1/completions`` field holding the prompt: token IDs there are read straight from the
body's bytes (``router.body.load_json_object``), by the fast lane first (``router.fastlane``)."""


def limits_of(app: web.Application) -> Limits:
    """The request limits of the app's config (``create_app`` computed them once)."""
    return app[keys.LIMITS]


def check_room(num_prompt: int, body: dict[str, Any], limits: Limits, param: str) -> None:
    """400 when a prompt of ``num_prompt`` tokens leaves no room for the output it asks for.

    vLLM refuses a prompt longer than ``max_model_len`` and clamps ``max_tokens`` to what is
    left; the router refuses both, naming the field, so a request never holds admission for
    tokens it cannot have (``max_completion_tokens`` wins over ``max_tokens`` when both are
    given, as in vLLM's chat ``build_tok_params``)."""
    room = limits.max_model_len - num_prompt
    if room < 1:
        raise BadRequest(f"'{param}' has {num_prompt} tokens; the model's max_model_len of {limits.max_model_len} "
                         "leaves no room for output", param=param)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(name)
    if asked is not None and asked > room:
        raise BadRequest(f"'{name}' is {asked} but the prompt's {num_prompt} tokens leave {room} of "
                         f"max_model_len {limits.max_model_len}", param=name)


async def read_completion(request: web.Request) -> tuple[ParsedRequest, list[int]]:
    """A ``/v1/completions`` request, validated, and the token IDs to route and send."""
    app, limits = request.app, limits_of(request.app)
    body, source = load_json_split(body_of(request), PROMPT_FIELD)
    parsed = parse_completion(body, request.headers, limits=limits, tenant=tenant_of(request), source=source)
    tokenizer = app[keys.TOKENIZER]
    if not isinstance(parsed.prompt, str):  # token IDs: a list, or TokenIds read from the JSON
        tokenizer.check_ids(parsed.prompt, "prompt", parsed.prompt_max_id)
        token_ids = parsed.prompt
    else:
        token_ids = await tokenizer.acompletion_ids(parsed.prompt, parsed.body.get("add_special_tokens", True))
    check_room(len(token_ids), parsed.body, limits, "prompt")
    return parsed, token_ids


async def read_chat(request: web.Request) -> tuple[ParsedRequest, list[int]]:
    """A ``/v1/chat/completions`` request, validated, and its token IDs as vLLM renders them."""
    app, limits = request.app, limits_of(request.app)
    parsed = parse_chat(load_json_object(body_of(request)), request.headers, limits=limits,
                        tenant=tenant_of(request))
    token_ids = await app[keys.TOKENIZER].achat_ids(parsed.messages, body=parsed.body)
    check_room(len(token_ids), parsed.body, limits, "messages")
    return parsed, token_ids


async def read_score(request: web.Request) -> tuple[ScoreRequest, list[int]]:
    """A ``/v1/score`` request, validated, and its context's token IDs. Each response must fit
    after the context with one token to spare (the scoring request generates one)."""
    app, limits = request.app, limits_of(request.app)
    req = parse_score(load_json_object(body_of(request)), request.headers, limits=limits,
                      tenant=tenant_of(request))
    tokenizer = app[keys.TOKENIZER]
    if req.messages is not None:
        context = await tokenizer.achat_ids(req.messages, add_generation_prompt=True)
    else:
        context = (req.context if isinstance(req.context, list)
                   else await tokenizer.acompletion_ids(req.context, param="context"))
    tokenizer.check_ids(context, "context", req.context_max_id if context is req.context else None)
    param = "context" if req.messages is None else "messages"
    check_room(len(context), {}, limits, param)
    for k, response in enumerate(req.responses):
        tokenizer.check_ids(response, f"responses[{k}]")
        if len(context) + len(response) >= limits.max_model_len:
            raise BadRequest(f"'responses[{k}]' has {len(response)} tokens; with the context's {len(context)} and the "
                             f"one token scoring generates they need more than max_model_len {limits.max_model_len} "
                             f"(at most {limits.max_model_len - 1 - len(context)} response tokens fit)",
                             param=f"responses[{k}]")
    return req, context
