"""Token IDs for text prompts and chat messages, with the replica model's own tokenizer.

The router hashes exactly the tokens the engine will see: completions are tokenized with
special tokens (BOS) unless the request sets ``add_special_tokens: false``, as vLLM's completions
endpoint does; chat messages are rendered with the model's chat template to text, then tokenized
with the request's ``add_special_tokens`` (default false), as vLLM 0.32 does
(``vllm/renderers/online_renderer.py`` ``preprocess_chat`` -> ``renderers/hf.py``
``safe_apply_chat_template``; ``ChatCompletionRequest.build_chat_params``): the request's
``chat_template_kwargs`` overlaid with ``add_generation_prompt``, ``continue_final_message``,
``documents`` and ``reasoning_effort`` (which also sets ``enable_thinking`` unless given).
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from router.errors import BadRequest


def _flatten_content(content: Any) -> str:
    """Chat content given as parts: text parts joined by newlines (vLLM's 'string' format)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadRequest("only text content parts are supported", param="messages")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-template variables a chat body asks for, merged as vLLM 0.32 merges them
    (``build_chat_params`` + ``merge_kwargs``: explicit fields over ``chat_template_kwargs``;
    None and "auto" leave a variable unset)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = body.get("reasoning_effort")
    explicit = {"add_generation_prompt": body.get("add_generation_prompt", True),
                "continue_final_message": body.get("continue_final_message", False),
                "documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in kwargs:
        explicit["enable_thinking"] = effort != "none"
    kwargs.update({k: v for k, v in explicit.items() if v is not None and v != "auto"})
    return kwargs


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer; tokenization runs off the event loop."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path)
        self._vocab_size = len(self._tok)  # len() of a HF tokenizer rebuilds its vocabulary: once

    @property
    def vocab_size(self) -> int:
        """Token IDs the model knows: ``[0, vocab_size)``."""
        return self._vocab_size

    def check_ids(self, token_ids: list[int], param: str) -> None:
        """BadRequest naming ``param`` when a token ID is outside ``[0, vocab_size)``.

        ``token_ids`` must already hold only ints (``router.parse`` checks): two C-speed passes
        (min, max); the offending ID is looked for only when one is out of range."""
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self._vocab_size):
            bad = next(t for t in token_ids if not 0 <= t < self._vocab_size)
            raise BadRequest(f"'{param}' holds token ID {bad}, outside the model's vocabulary "
                             f"[0, {self._vocab_size})", param=param)

    def completion_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token IDs of a text prompt, with BOS as vLLM's completions add it (unless asked not to)."""
        return self._encode(prompt, add_special_tokens, "prompt")

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                 body: Mapping[str, Any] | None = None) -> list[int]:
        """Token IDs of chat ``messages`` as vLLM renders them for a chat ``body`` (default: a body
        with only ``add_generation_prompt``)."""
        body = body if body is not None else {"add_generation_prompt": add_generation_prompt}
        flat = [{**m, "content": _flatten_content(m.get("content"))} for m in messages]
        try:
            text = self._tok.apply_chat_template(flat, tokenize=False, **template_kwargs(body))
        except Exception as exc:  # template errors are the caller's messages' fault
            raise BadRequest(f"chat template failed on 'messages': {exc}", param="messages") from exc
        return self._encode(text, bool(body.get("add_special_tokens", False)), "messages")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        except (TypeError, ValueError) as exc:  # text no tokenizer accepts: the caller's
            raise BadRequest(f"'{param}' cannot be tokenized: {exc}", param=param) from exc

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    async def acompletion_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.to_thread(self.completion_ids, prompt, add_special_tokens)

    async def achat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                        body: Mapping[str, Any] | None = None) -> list[int]:
        return await asyncio.to_thread(self.chat_ids, messages, add_generation_prompt, body=body)
