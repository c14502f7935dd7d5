"""A relayed stream that says which versions computed its tokens (README "Version contract").

:func:`relay_events` reads the replica's events as fast as they come, ahead of the client, and
counts each one's tokens when it is *read* (``StreamWatch.on_event``), so when a weight update
marks where a kept stream changes version (``router.weights.steps``), every token the engine
produced before its pause is already counted, however slowly the client reads.

Nothing goes to the client before the stream's first token (or its end): the events before it
(a chat stream's role chunk) are held, and ``begin(aborted)`` runs just before the first byte.
Until then the request is as a non-streamed one that has not answered: a weight update or a
stalled replica can take it back whole, and ``begin`` may refuse to start (raise) when the
engine aborted it before a token (``aborted``) or its replica's version moved meanwhile. Token
chunks then go to the client at once; a chunk that may be the last one (a finish reason, usage,
or no choices) is held until the next event, so the chunk before ``[DONE]`` gets the
``rollout_router`` object (or, when none was held, a chunk of its own with ``choices: []``, as
vLLM's usage chunk).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web


class ReplicaStreamError(Exception):
    """The replica ended a stream that had begun with an error event of its own (vLLM's, e.g.
    its engine core died: ``InternalServerError``); the message is the replica's. The relay
    ends the stream with the router's error event instead (``router.proxy.relay_stream``)."""


Begin = Callable[[bool, "dict[str, Any] | None"], Awaitable[None]]
"""Called once, just before the stream's first byte goes to the client, with whether the engine
aborted it before any token (a ``finish_reason: "abort"`` and no token yet) and the error event
the replica sent before any token (its JSON object ``{"error": {...}}``, else None); it sends
the head, or raises to take the request back (nothing has reached the client)."""


async def relay_events(resp: web.StreamResponse, up: aiohttp.ClientResponse, watch: Any, tail_bytes: int,
                       begin: Begin) -> bytes:
    """Relay ``up``'s events to ``resp`` (started by ``begin``); the last ``tail_bytes`` bytes
    read. Raises what reading upstream raised (aiohttp.ClientError, asyncio.TimeoutError), what
    writing to the client did, or what ``begin`` did; ``resp.prepared`` tells whether anything
    had gone to the client."""
    queue: asyncio.Queue = asyncio.Queue()
    tail = [b""]
    reader = asyncio.ensure_future(_read(up, watch, queue, tail_bytes, tail))
    writer = _Writer(resp, watch, begin)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            await writer.event(*item)
            if item[0].strip() == _DONE:  # the client has the whole answer: its SDK may close at once,
                break  # before the replica ends its response (then waiting for that end was a "499")
        await writer.flush()
        return tail[0]
    finally:
        if not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


_DONE = b"data: [DONE]"
"""The stream's last event (OpenAI's protocol; vLLM sends it last)."""


async def _read(up: aiohttp.ClientResponse, watch: Any, queue: asyncio.Queue, tail_bytes: int,
                tail: list[bytes]) -> None:
    """Queue ``up``'s events, then None at its end (or the error reading it raised); ``tail[0]``:
    the last ``tail_bytes`` bytes read so far."""
    buf = b""
    try:
        async for chunk in up.content.iter_any():
            tail[0] = (tail[0] + chunk)[-tail_bytes:]
            buf += chunk
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                event = _decode(raw)
                if event is not None:
                    watch.on_event(event)
                queue.put_nowait((raw, event))
        if buf:
            queue.put_nowait((buf, None))
        queue.put_nowait(None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        queue.put_nowait(exc)


class _Writer:
    def __init__(self, resp: web.StreamResponse, watch: Any, begin: Begin) -> None:
        self.resp, self.watch, self.begin = resp, watch, begin
        self.before: list[tuple[bytes, dict[str, Any] | None]] | None = []
        """Events read before the first token (None once the stream began)."""
        self.aborted = False
        self.error: dict[str, Any] | None = None
        self.held: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}

    async def event(self, raw: bytes, event: dict[str, Any] | None) -> None:
        if self.before is None:
            return await self._relay(raw, event)
        self.before.append((raw, event))
        choices = (event or {}).get("choices") or []
        reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)]
        self.aborted = self.aborted or "abort" in reasons
        if event is None:
            self.error = _error_of(raw)
        # begins at the first token, a finish, or an event without choices (the usage chunk; a
        # chat role chunk, even with continuous usage stats, waits for the token behind it)
        if event is None or any(self.watch.tokens.values()) or any(reasons) or not choices:
            await self._start()

    async def flush(self) -> None:
        """The stream ended: begin it if no token came (nothing held back stays unsent)."""
        if self.before is not None:
            await self._start()
        await self._write_held()

    async def _start(self) -> None:
        before, self.before = self.before or [], None
        await self.begin(self.aborted and not any(self.watch.tokens.values()), self.error)
        for raw, event in before:
            await self._relay(raw, event)

    async def _relay(self, raw: bytes, event: dict[str, Any] | None) -> None:
        if raw.startswith(b"data:") and raw[5:].strip() == b"[DONE]":
            final = self.held or {k: self.last[k] for k in ("id", "object", "created", "model") if k in self.last}
            final = {**final, "choices": final.get("choices", []), "rollout_router": self.watch.final(_cached(self.held))}
            self.held = None
            await self.resp.write(b"data: " + json.dumps(final).encode() + b"\n\n" + raw + b"\n\n")
            return
        await self._write_held()
        if event is None:
            error = _error_of(raw)
            if error is not None:  # the replica broke the stream after it began
                detail = error["error"]
                message = detail.get("message", detail) if isinstance(detail, dict) else detail
                raise ReplicaStreamError(str(message)[:500])
            await self.resp.write(raw + b"\n\n")
            return
        self.last = event
        choices = event.get("choices") or []
        if event.get("usage") or not choices or any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
            self.held = event
        else:
            await self.resp.write(raw + b"\n\n")

    async def _write_held(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            await self.resp.write(b"data: " + json.dumps(held).encode() + b"\n\n")


def _decode(raw: bytes) -> dict[str, Any] | None:
    """A ``data:`` event's JSON object (not an error event), else None."""
    if not raw.startswith(b"data:"):
        return None
    try:
        event = json.loads(raw[5:])
    except ValueError:
        return None
    return event if isinstance(event, dict) and "error" not in event else None


def _error_of(raw: bytes) -> dict[str, Any] | None:
    """An error event's object (``data: {"error": {...}}``: vLLM ends a stream so when it refuses
    the request inside its generator, ``code`` 400, or when its engine failed), else None."""
    if not raw.startswith(b"data:") or b'"error"' not in raw:
        return None
    try:
        event = json.loads(raw[5:])
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("error") is not None else None


def _cached(event: dict[str, Any] | None) -> int | None:
    usage = (event or {}).get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) else None
