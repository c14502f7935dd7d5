"""Token IDs for text prompts and chat messages, with the replica model's own tokenizer.

The router hashes exactly the tokens the engine will see: completions are tokenized with
special tokens (BOS) as vLLM's completions endpoint does; chat messages are rendered with the
model's chat template and tokenized without adding special tokens again, as vLLM's chat
endpoint does (`vllm/entrypoints/openai/serving_chat.py` -> `apply_hf_chat_template`).
"""

from __future__ import annotations

import asyncio
from typing import Any

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


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer; tokenization runs off the event loop."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def check_ids(self, token_ids: list[int], param: str) -> None:
        """BadRequest naming ``param`` when a token ID is outside ``[0, vocab_size)``."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"'{param}' holds token ID {bad}, outside the model's vocabulary "
                             f"[0, {self.vocab_size})", param=param)

    def completion_ids(self, prompt: str) -> list[int]:
        return list(self._tok(prompt, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        flat = [{**m, "content": _flatten_content(m.get("content"))} for m in messages]
        try:
            text = self._tok.apply_chat_template(flat, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:  # template errors are the caller's messages' fault
            raise BadRequest(f"chat template failed on 'messages': {exc}", param="messages") from exc
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    async def acompletion_ids(self, prompt: str) -> list[int]:
        return await asyncio.to_thread(self.completion_ids, prompt)

    async def achat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return await asyncio.to_thread(self.chat_ids, messages, add_generation_prompt)
