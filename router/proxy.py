"""Forwarding one request to one replica: JSON (``router.upstream``) or a relayed event stream.

A replica that cannot be reached raises `ReplicaUnreachable` (nothing reached the client, so
the caller may retry elsewhere). A client that disconnects cancels the handler; leaving the
``async with`` closes the upstream connection, and vLLM aborts the request and frees its KV
cache (`vllm/entrypoints/utils.py` ``with_cancellation`` / the streaming generator).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from replicas.auth import PROCESS_KEYS, bearer
from router.errors import UpstreamError, error_body
from router.lifecycle import RetryElsewhere
from router.token_ids import TokenIds
from router.upstream import ReplicaClient, ReplicaUnreachable
from router.weights.stream import ReplicaStreamError, relay_events

log = logging.getLogger(__name__)


FAILED = web.ResponseKey("rollout_failed", str)
"""Set on a relayed stream that ended with an error event after it started: ``"failed"`` (its
replica broke it) or ``"ended"`` (the router ended it: ``StreamWatch.end``), the outcome the
lifecycle gives it (``cache_policy.core.Outcome``)."""
CACHED_TOKENS = web.ResponseKey("rollout_cached_tokens", object)
"""Set on a relayed stream: the cached prompt tokens its usage chunk reported (None: no usage)."""

_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""A pooled keep-alive connection the server had closed, a broken pipe or a reset: tried once
more on a fresh connection to the same replica before the replica counts as failing."""


_JSON = {"Content-Type": "application/json"}
def _as_json(value: Any) -> msgspec.Raw:
    """A :class:`router.token_ids.TokenIds` as the JSON text it was read from (msgspec's hook
    for a type it cannot encode; TypeError for any other, as msgspec raises)."""
    if type(value) is TokenIds:
        return msgspec.Raw(value.json)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


_ENCODE = msgspec.json.Encoder(enc_hook=_as_json).encode


def encode_body(body: dict[str, Any]) -> bytes:
    """``body`` as compact UTF-8 JSON (msgspec: a 4,000-token prompt in tens of microseconds,
    ``json.dumps`` takes hundreds; a ``TokenIds`` prompt is copied as the text it was read from).
    Bodies hold only what JSON decoding gave (``router.body`` refuses non-finite numbers and lone
    surrogates) plus strings and ints the router sets."""
    return _ENCODE(body)


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[URL, str]:
    """``url`` parsed (each replica's few paths, once) and its origin (``replicas.auth.origin``)."""
    parsed = URL(url)
    return parsed, f"{parsed.scheme}://{parsed.host}:{parsed.port}"


@functools.lru_cache(maxsize=256)
def _headers(key: str | None) -> dict[str, str]:
    """The headers of a request to a replica with ``key`` (None: it needs none)."""
    return _JSON if key is None else {**_JSON, **bearer(key)}


async def _send(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST ``body``, once more on a fresh connection if the first one was stale.

    The replica's key (``replicas.auth.PROCESS_KEYS``, as the router's session middleware adds
    it) is set here, and the session's middlewares are skipped: one dict lookup instead of a
    middleware chain and a URL parse per request. Raises ReplicaUnreachable (``refused`` when
    nobody listens)."""
    data = encode_body(body)  # once, whatever the attempts
    target, origin_name = _target(url)
    headers = _headers(PROCESS_KEYS.key(origin_name))
    for attempt in (1, 2):
        try:
            return await http.post(target, data=data, headers=headers, middlewares=())
        except aiohttp.ClientConnectorError as exc:
            raise ReplicaUnreachable(f"{url}: {exc!r}", refused=True) from exc
        except _STALE as exc:
            if attempt == 2:
                raise ReplicaUnreachable(f"{url}: {exc!r} (twice, on a fresh connection too)") from exc
            log.info("stale connection to %s (%r): once more on a fresh one", url, exc)
        except aiohttp.ClientConnectionError as exc:
            raise ReplicaUnreachable(f"{url}: {exc!r}") from exc
    raise AssertionError("unreachable")


class UpstreamResult:
    """A non-streamed upstream answer: its HTTP status, its bytes (``raw``) and, decoded on first
    read, its JSON (``payload``: None if not JSON). A completion's answer is mostly never decoded
    whole: :meth:`usage` reads only its ``usage`` member, and ``router.responses.json_answer``
    splices the ``rollout_router`` object into the bytes (:meth:`spliceable`)."""

    __slots__ = ("status", "raw", "_payload", "_strict", "_usage", "_spliceable")

    def __init__(self, status: int, raw: bytes) -> None:
        self.status, self.raw = status, raw
        self._payload: Any = _UNREAD
        self._strict = True
        self._usage: Any = _UNREAD
        self._spliceable = False

    @property
    def payload(self) -> Any:
        """The body decoded: by msgspec (about 4x faster), else by ``json``, whose verdict stands
        (``NaN``, ``-Infinity``, integers past 64 bits, invalid JSON: as in ``router.body``)."""
        if self._payload is _UNREAD:
            self._payload, self._strict = _decode(self.raw)
        return self._payload

    @property
    def strict(self) -> bool:
        """The body was strict JSON (msgspec decoded it): re-encoding it with msgspec gives the same
        values. False when only ``json`` could (``NaN``, ``Infinity``), which ``json.dumps`` keeps."""
        self.payload  # noqa: B018 - decodes it
        return self._strict

    def usage(self) -> dict[str, Any] | None:
        """The answer's ``usage`` object (None when it is no JSON object or has no such object).
        Read alone when the body is strict JSON, the rest parsed but not built (a completion with
        prompt logprobs is tens of KB of JSON)."""
        if self._usage is _UNREAD:
            if self._payload is _UNREAD:
                try:
                    answer = _DECODE_USAGE(self.raw)
                    self._usage = answer.usage
                    # its members skipped unbuilt, msgspec did not check their UTF-8
                    self._spliceable = answer.rollout_router is msgspec.UNSET and _utf8(self.raw)
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                    pass
            if self._usage is _UNREAD:
                payload = self.payload
                self._usage = payload.get("usage") if isinstance(payload, dict) else None
            if not isinstance(self._usage, dict):
                self._usage = None
        return self._usage

    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` (:func:`cached_tokens_of`)."""
        return cached_tokens_of(self.usage())

    def completion_tokens(self) -> int | None:
        """``usage.completion_tokens`` (None if absent)."""
        n = (self.usage() or {}).get("completion_tokens")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None

    def aborted(self) -> bool:
        """Some choice ended with ``finish_reason: "abort"``: the engine stopped it part way (a
        weight update's ``/pause?mode=abort`` run by any router, or vLLM's own abort), so the
        answer is partial."""
        if b'"abort"' not in self.raw:
            return False
        payload = self.payload
        choices = payload.get("choices") if isinstance(payload, dict) else None
        return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort"
                                                 for c in choices)

    def replica_failed(self) -> bool:
        """The replica, not the request, is at fault: a 5xx, or a 401 (the router's own key was
        refused: a replica restarted or removed under it, ``replicas.auth``; the client's headers
        are never sent on). Such an answer is run elsewhere, never relayed: nothing reached the
        client yet."""
        return self.status >= 500 or self.status == 401

    def spliceable(self) -> bool:
        """Whether the body is one strict JSON object in valid UTF-8 without a ``rollout_router``
        member, however its key is spelled: bytes that can be passed on as they are with that
        member added (``router.responses.splice_annotation``)."""
        self.usage()
        return self._spliceable


_UNREAD = object()


def cached_tokens_of(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer's ``usage``: the prompt tokens
    the replica reused (None if absent, not an int or negative, whatever the types around it: a
    negative count made the counters raise after the client had its answer)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def _utf8(raw: bytes) -> bool:
    if raw.isascii():  # most answers: no decode
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _Answer(msgspec.Struct):
    """A JSON object whose ``usage`` member alone is built (``UpstreamResult.usage``), and whose
    ``rollout_router`` member, if it has one (msgspec reads an escaped key as its name)."""

    usage: Any = None
    rollout_router: Any = msgspec.UNSET


_DECODE_USAGE = msgspec.json.Decoder(_Answer).decode


def encode_parts(body: dict[str, Any]) -> tuple[bytes, ...]:
    """:func:`encode_body`'s JSON in pieces to write one after another: a ``TokenIds`` prompt's
    text (tens of KB) goes out as the client sent it, not copied into the body and again into
    the request (``ReplicaClient.post`` writes the pieces with ``writelines``). The prompt comes
    first; the object's members are the same."""
    prompt = body.get("prompt")
    if type(prompt) is not TokenIds:
        return (encode_body(body),)
    tail = _ENCODE({k: v for k, v in body.items() if k != "prompt"})
    return b'{"prompt":', prompt.json, b"}" if tail == b"{}" else b"," + tail[1:]


async def post_json(client: ReplicaClient, url: str, body: dict[str, Any],
                    on_answer: Callable[[int, bytes], object] | None = None) -> UpstreamResult:
    """POST ``body`` and read the whole answer (``router.upstream``: pooled connections, one
    more try on a fresh one when a kept-alive connection was closed). Raises ReplicaUnreachable
    (``refused`` when nobody listens; never a partial answer) or UpstreamError (timed out).
    ``on_answer(status, raw)``: called as the whole answer is read (``ReplicaClient.post``)."""
    try:
        status, raw = await client.post(url, encode_parts(body), on_answer)
    except TimeoutError as exc:
        raise UpstreamError(f"replica timed out on {url}") from exc
    return UpstreamResult(status, raw)


_TAIL_BYTES = 8192
"""How much of a stream's end is kept to read its usage chunk (the last ``data:`` event)."""


def stream_cached_tokens(tail: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of the last event carrying usage, if any
    (vLLM sends it when the client asked ``stream_options.include_usage``)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                usage = json.loads(line[5:]).get("usage") or {}
            except (ValueError, AttributeError):
                return None
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            return cached if isinstance(cached, int) else None
    return None


class _Refused(Exception):
    """A stream the replica refused with a 4xx error event before its first token (vLLM checks
    some fields, ``logprobs`` above its limit among them, inside its generator)."""

    def __init__(self, status: int, raw: bytes) -> None:
        super().__init__(status)
        self.status, self.raw = status, raw


STREAM_ERROR_CODE = 503
"""The code of the error event that ends a stream its replica broke: retriable, as a 503 is."""


async def _end_with_error(resp: web.StreamResponse, message: str, note: dict[str, Any] | None = None) -> None:
    """Close a started stream properly: an OpenAI-style error event (with ``note``, the
    ``rollout_router`` object of the tokens it did relay, when given), then ``[DONE]``."""
    event = error_body(STREAM_ERROR_CODE, message)
    if note is not None:
        event["rollout_router"] = note
    try:
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, RuntimeError):  # the client is gone too
        pass


def _note_of(watch: Any) -> dict[str, Any] | None:
    """The ``rollout_router`` object of the tokens a stream relayed before it broke (which versions
    computed them); None when it cannot be built (the error event goes out all the same)."""
    try:
        return watch.final(None)
    except Exception:  # noqa: BLE001 - a bug here must not keep the stream from its end
        log.exception("the note of a stream ended by an error could not be built")
        return None


_DECODE = msgspec.json.Decoder().decode


def _decode(raw: bytes) -> tuple[Any, bool]:
    """``raw`` as JSON (None if it is none, or empty) and whether msgspec could read it."""
    if not raw:
        return None, True
    try:
        return _DECODE(raw), True
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return json.loads(raw), False
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # nested past the stack too
        return None, False


async def relay_stream(client: web.Request, http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       headers: dict[str, str], watch: Any,
                       start: Callable[[bool], None] | None = None) -> web.StreamResponse | UpstreamResult:
    """POST a streaming request and relay the server-sent events to ``client`` as they come.

    An upstream error status comes back as an :class:`UpstreamResult` (nothing sent to
    ``client``), for the caller to answer as it answers a non-streamed one. Nothing goes to
    ``client`` before the stream's first token (``router.weights.stream``): until then the
    request can run again, so ``start(aborted)`` is called just before the first byte (it may
    raise to take the request back: ``aborted``, the engine ended it before any token), and a
    replica that fails before it (its connection breaks, or it sends a 5xx error event) raises
    :class:`RetryElsewhere`; a 4xx error event before it comes back as an :class:`UpstreamResult`
    of that status, as an error status would. Raises ReplicaUnreachable when
    the replica cannot be reached. ``watch`` (``router.weights.report.StreamWatch``) counts each
    event as it is read and gives the final chunk before ``[DONE]`` its ``rollout_router`` object.
    A replica that fails after the first byte (its connection breaks, or it sends an error
    event of its own: vLLM's ``InternalServerError`` when its engine core died) ends the stream
    with the router's error event, code 503, "retry the request" (``FAILED``).
    """
    up = await _send(http, url, body)
    watch.relaying(up.close)
    resp = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
    resp.content_type = "text/event-stream"

    async def begin(aborted: bool, error: dict[str, Any] | None) -> None:
        if error is not None:  # nothing reached the client: answered as the same error unstreamed
            detail = error["error"]
            code = detail.get("code") if isinstance(detail, dict) else None
            if isinstance(code, int) and 400 <= code < 500:  # it refused the request: a 4xx, not retried
                raise _Refused(code, json.dumps(error).encode())
            message = detail.get("message", detail) if isinstance(detail, dict) else detail
            raise RetryElsewhere(f"the replica ended the stream with an error before its first token: "
                                 f"{str(message)[:500]}")
        if start is not None:
            start(aborted)
        await resp.prepare(client)

    whole = False
    try:
        if up.status != 200:
            return UpstreamResult(up.status, await up.read())
        try:
            tail = await relay_events(resp, up, watch, _TAIL_BYTES, begin)
            await resp.write_eof()
            resp[CACHED_TOKENS] = stream_cached_tokens(tail)
            whole = True
        except _Refused as refused:  # as an error status before the stream: the caller answers it
            up.close()
            return UpstreamResult(refused.status, refused.raw)
        except ConnectionResetError:  # the client went away mid-stream: an expected outcome
            log.info("client disconnected from %s mid-stream; aborting upstream", url)
            up.close()  # dropping the upstream connection makes vLLM abort and free the KV cache
        except (aiohttp.ClientError, asyncio.TimeoutError, ReplicaStreamError) as exc:  # the replica failed
            up.close()                                          # mid-stream, or was left paused (``watch.ended``)
            why = watch.ended or (f"the replica ended the stream with an error: {exc}"
                                  if isinstance(exc, ReplicaStreamError)
                                  else f"the replica failed mid-stream ({type(exc).__name__})")
            if not resp.prepared:  # before its first token: nothing reached the client
                raise RetryElsewhere(f"{why} before the stream's first token on {url}: {exc!r}") from exc
            log.warning("stream from %s ended mid-way: %s (%r); ending it with an error event", url, why, exc)
            resp[FAILED] = "ended" if watch.ended else "failed"
            await _end_with_error(resp, f"{why}; retry the request", _note_of(watch))
        return resp
    except BaseException:
        up.close()  # client went away, or the request is taken back: vLLM aborts it
        if resp.prepared:  # or the router is stopping: end the stream properly
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await _end_with_error(resp, "the router stopped while streaming; retry the request")
        raise
    finally:
        watch.relaying(None)  # ended: nothing to end any more
        if whole and not up.content.at_eof():  # [DONE] relayed, the response's end not read yet
            _release_at_end(up)
        else:
            up.release()


_END_WAIT_S = 2.0
"""How long a stream's upstream response may take to end after its ``[DONE]`` (vLLM's end follows
it at once) before its connection is closed instead of pooled."""
_ENDING: set[asyncio.Task] = set()


def _release_at_end(up: aiohttp.ClientResponse) -> None:
    """Read the rest of ``up`` (after ``[DONE]``: the chunked body's end) off the request's path,
    then give its connection back to the pool; closed after :data:`_END_WAIT_S` or on any error.
    The relay stops at ``[DONE]`` (a client may close at once), and releasing a response not read
    to its end closes its connection: every stream then opened a new one to its replica."""

    async def finish() -> None:
        try:
            async with asyncio.timeout(_END_WAIT_S):
                while await up.content.readany():
                    pass
            up.release()
        except BaseException:
            up.close()
            raise

    task = asyncio.get_running_loop().create_task(finish())
    _ENDING.add(task)
    task.add_done_callback(_ending_done)


def _ending_done(task: asyncio.Task) -> None:
    _ENDING.discard(task)
    if not task.cancelled() and task.exception() is not None:  # its connection closed: nothing lost
        log.debug("a stream's upstream response did not end cleanly after [DONE]: %r", task.exception())
