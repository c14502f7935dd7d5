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
import threading
from typing import Any, Mapping

from router.errors import BadRequest, echo
from router.token_ids import min_max


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


NO_TOKENIZER = ("text prompts need a tokenizer: set router.tokenizer (a Hugging Face path or name; with "
                "replicas.urls it defaults to the served model's folder when /v1/models names a local one), "
                "or send token IDs")
"""The 400 a text prompt, chat messages or a text scoring context get from a router without a tokenizer."""


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer, loaded on first use; tokenization runs off the event loop.

    ``path`` None: the router has no tokenizer (it fronts servers whose model it cannot read).
    Token-ID prompts still work (their vocabulary check is left to the replica, whose 400 the
    router passes on); a text prompt, chat messages or a text context are a 400 naming the field.
    """

    def __init__(self, path: str | None):
        self.path = path
        self._tok: Any = None
        self._vocab_size: int | None = None
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load the tokenizer now (blocking; once). ``OSError``/``ValueError`` from Hugging Face
        when ``path`` is neither a tokenizer folder nor a name it can fetch; nothing when ``path`` is None."""
        if self.path is None or self._tok is not None:
            return
        with self._lock:
            if self._tok is None:
                from transformers import AutoTokenizer  # only a router with a tokenizer pays for transformers

                tok = AutoTokenizer.from_pretrained(self.path)
                self._vocab_size = len(tok)  # len() of a HF tokenizer rebuilds its vocabulary: once
                self._tok = tok

    def _loaded(self, param: str) -> Any:
        if self.path is None:
            raise BadRequest(f"'{param}' is text, and {NO_TOKENIZER}", param=param)
        self.load()
        return self._tok

    @property
    def available(self) -> bool:
        """True when the router has a tokenizer (text prompts work)."""
        return self.path is not None

    @property
    def vocab_size(self) -> int | None:
        """Token IDs the model knows: ``[0, vocab_size)``; None without a tokenizer."""
        self.load()
        return self._vocab_size

    def check_ids(self, token_ids: list[int], param: str, max_id: int | None = None) -> None:
        """BadRequest naming ``param`` when a token ID is outside ``[0, vocab_size)``.

        ``token_ids`` must already hold only ints (``router.parse`` checks): C-speed bounds
        (``router.token_ids.min_max``); the offending ID is looked for only when one is out of
        range. ``max_id``: the largest ID of IDs already checked to be ``>= 0`` (``router.parse``
        found it), so they are not walked again. Without a tokenizer nothing is checked here."""
        vocab = self.vocab_size
        if vocab is None:  # no tokenizer: the replica checks (its 400 is passed on, naming ``param``)
            return
        if max_id is not None:
            lo, hi = 0, max_id
        else:
            lo, hi = min_max(token_ids) if token_ids else (0, 0)
        if lo < 0 or hi >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise BadRequest(f"'{param}' holds token ID {echo(bad)}, outside the model's vocabulary "
                             f"[0, {vocab})", param=param)

    def completion_ids(self, prompt: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token IDs of a text prompt, with BOS as vLLM's completions add it (unless asked not to).
        BadRequest naming ``param`` when it cannot be tokenized or there is no tokenizer."""
        return self._encode(prompt, add_special_tokens, param)

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                 body: Mapping[str, Any] | None = None) -> list[int]:
        """Token IDs of chat ``messages`` as vLLM renders them for a chat ``body`` (default: a body
        with only ``add_generation_prompt``)."""
        body = body if body is not None else {"add_generation_prompt": add_generation_prompt}
        tok = self._loaded("messages")
        flat = [{**m, "content": _flatten_content(m.get("content"))} for m in messages]
        try:
            text = tok.apply_chat_template(flat, tokenize=False, **template_kwargs(body))
        except Exception as exc:  # template errors are the caller's messages' fault
            raise BadRequest(f"chat template failed on 'messages': {exc}", param="messages") from exc
        return self._encode(text, bool(body.get("add_special_tokens", False)), "messages")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        tok = self._loaded(param)
        try:
            return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        except (TypeError, ValueError) as exc:  # text no tokenizer accepts: the caller's
            raise BadRequest(f"'{param}' cannot be tokenized: {exc}", param=param) from exc

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``; BadRequest (param ``token_ids``) without a tokenizer."""
        return self._loaded("token_ids").decode(token_ids)

    async def acompletion_ids(self, prompt: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """:meth:`completion_ids` off the event loop."""
        if self.path is None:  # the 400 at once, without a thread
            self._loaded(param)
        return await asyncio.to_thread(self.completion_ids, prompt, add_special_tokens, param)

    async def achat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                        body: Mapping[str, Any] | None = None) -> list[int]:
        """:meth:`chat_ids` off the event loop."""
        if self.path is None:
            self._loaded("messages")
        return await asyncio.to_thread(self.chat_ids, messages, add_generation_prompt, body=body)
