"""The fast lane: plain ``POST /v1/completions`` requests served on a bare asyncio protocol; every
other request, and every connection once it sends one, served by aiohttp.

Why: an aiohttp server costs a proxy about 0.37 ms per request over a bare uvloop protocol
(``bench.h2h.ab``: the aiohttp server with ours' replica client vs ``bench.h2h.bare``), a third of
what the router adds to a completion. The lane removes that cost for the request RL rollouts send
most: a non-streamed completion.

What the lane takes: a request whose head has arrived whole (at most ``router.max_header_bytes``)
and says plainly ``POST /v1/completions HTTP/1.1``, without a query, in ASCII header lines with
RFC 9110 names, one ``Host``, one ``Content-Length`` of at most ``router.max_body_bytes``, at most
one ``Connection`` and no ``Transfer-Encoding``, ``Content-Encoding``, ``Expect`` or ``Upgrade``,
and whose body is UTF-8 JSON (no BOM, no UTF-16/32, which ``json.loads`` would read) holding
neither the word ``"stream"`` (a stream is relayed by aiohttp) nor a ``\\u`` escape (which could
spell that key). Anything else hands the connection to aiohttp's own protocol
(``aiohttp.web_protocol.RequestHandler``) with every byte not yet answered replayed: aiohttp then
judges the request as if it had seen the connection from the start (its parser's 400s, its header
and keep-alive timers, chunked and compressed bodies) and keeps the connection. So does a request
whose API key the edge would refuse while its body is still arriving (``router.edge.head_check``:
the 401 at once, not after the body).

The same rules, not a copy: a lane request runs through the app's own middlewares (drain,
metrics, errors, edge) and its own handler, composed as aiohttp composes them, with
:class:`FastRequest` standing in for aiohttp's request (the few attributes they read). What is
the lane's own: the HTTP framing of the answer (:func:`encode_response`), the body deadline
(``router.body_timeout_s``: the edge's 408), the idle deadline (``router.header_timeout_s``, as
aiohttp's keep-alive timer), cancelling the handler when the client goes away (as aiohttp's
``handler_cancellation``), taking no request while the client does not read its answers (write
back-pressure), counting the requests it ends itself (``RouterMetrics.count_request``), and
closing its connections on shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from http import HTTPStatus
from typing import Any, Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from cache_policy.native import NATIVE
from router import keys
from router.edge import body_late
from router.errors import error_response
from router.intake import PROMPT_FIELD
from router.metrics import ENDPOINT_PATHS
from router.token_ids import split_ids

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[web.StreamResponse]]

FAST_PATH = "/v1/completions"
_REFUSED_HEADERS = frozenset({"transfer-encoding", "content-encoding", "expect", "upgrade"})
_OWN_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_PHRASES = {s.value: s.phrase for s in HTTPStatus}
_MAX_LENGTH = 10**12
"""Past any ``Content-Length`` the lane takes (at most 12 digits): a larger ``max_body`` is the same."""
_CLOSE_SHUTDOWN_S = 5.0
"""How long a stopping router waits for lane requests still running (aiohttp's shutdown_timeout)."""


class _WholeBody:
    """``request.content`` of a :class:`FastRequest`: its body has arrived whole."""

    total_compressed_bytes = None

    @staticmethod
    def is_eof() -> bool:
        return True


class FastRequest(dict):
    """The part of ``aiohttp.web.Request`` the middlewares and the completions handler read:
    ``app``, ``method``, ``path``, ``headers`` (case-insensitive), ``body_exists``,
    ``content_length``, ``content``, ``read()`` and item storage (``request[KEY]``). A handler
    answering early (``router.responses.send_now``) calls :meth:`answer`."""

    __slots__ = ("app", "headers", "_body", "_lane", "answered")
    method = "POST"
    path = FAST_PATH
    body_exists = True
    content = _WholeBody()

    def __init__(self, app: web.Application, headers: CIMultiDictProxy[str], body: bytes, lane: FastLane) -> None:
        self.app, self.headers, self._body, self._lane = app, headers, body, lane
        self.answered = False

    @property
    def content_length(self) -> int:
        return len(self._body)

    async def read(self) -> bytes:
        return self._body

    def answer(self, resp: web.Response) -> None:
        """Write ``resp`` (a ``web.Response`` or a ``router.responses.JsonAnswer``) to the client
        now (once; the lane writes nothing more for it).
        ConnectionResetError when the client is gone, as aiohttp's writer raises."""
        if self.answered:
            return
        self.answered = True
        try:
            self._lane.write_response(resp)
        except ConnectionResetError:
            raise
        except Exception as exc:  # a bug in framing: the client sees the connection close, not a hang
            log.exception("fast lane: could not write the answer to %s", FAST_PATH)
            self._lane.close()
            raise ConnectionResetError("the answer could not be written; connection closed") from exc


def encode_response(resp: web.Response, *, close: bool) -> bytes:
    """``resp`` as HTTP/1.1 bytes: status line, its headers, ``Content-Length``, ``Connection:
    close`` when ``close``, then its body (``bytes``: TypeError for a streamed or payload body,
    which no answer of the completions handler has). ``resp``: a ``web.Response`` or anything
    with its ``status``, ``reason``, ``headers`` and ``body`` (``router.responses.JsonAnswer``,
    whose ``head``, when set, is its :func:`encode_head` framed ahead)."""
    body = resp.body if resp.body is not None else b""
    if not isinstance(body, (bytes, bytearray)):
        raise TypeError(f"the fast lane frames whole bodies only, not {type(body).__name__}")
    status = resp.status
    head = getattr(resp, "head", None) or encode_head(resp)
    if status < 200 or status in (204, 304):  # RFC 9110 6.4.1, 8.6: no body, no Content-Length
        body, length = b"", b""  # a replica's bytes after one would read as the next answer
    else:
        length = b"Content-Length: %d\r\n" % len(body)
    return b"".join((head, length, b"Connection: close\r\n\r\n" if close else b"\r\n", body))


def encode_head(resp: web.Response) -> bytes:
    """The status line and header lines of ``resp`` (each ending in CRLF), without the
    ``Content-Length``, ``Transfer-Encoding`` and ``Connection`` the lane frames itself."""
    reason = resp.reason or _PHRASES.get(resp.status, "")  # a status without one (299, 430): "HTTP/1.1 299 ", as aiohttp
    lines = [f"HTTP/1.1 {resp.status} {reason}"]
    lines.extend(f"{k}: {v}" for k, v in resp.headers.items() if k.lower() not in _OWN_HEADERS)
    return ("\r\n".join(lines) + "\r\n").encode("utf-8")  # as aiohttp encodes headers


class FastLane(asyncio.Protocol):
    """One client connection, served by the lane until a request it does not take arrives.

    ``handler``: the app's middlewares composed over the completions handler
    (:func:`chain`); ``aiohttp_protocol``: makes aiohttp's protocol for a handed-off connection
    (the runner's ``web.Server``); ``lanes``: the connections the lane holds now (closed on
    shutdown)."""

    def __init__(self, app: web.Application, handler: Handler, aiohttp_protocol: Callable[[], asyncio.Protocol],
                 lanes: set[FastLane], *, max_head: int, max_body: int, idle_s: float, body_s: float,
                 head_check: Callable[[CIMultiDictProxy[str]], bool] = lambda _: True) -> None:
        self.app, self.handler, self.aiohttp_protocol, self.lanes = app, handler, aiohttp_protocol, lanes
        self.head_check = head_check
        self.max_head, self.max_body, self.idle_s, self.body_s = max_head, max_body, idle_s, body_s
        self.max_buffer = max_head + 4 + max_body
        """The most one request takes (its head, the blank line, its body): past it the lane reads
        no more until the requests buffered are served."""
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        """When ``_on_deadline`` is due (loop time); the timer may fire earlier and wait on."""
        self._on_deadline: Callable[[], None] | None = None
        self._closing = False
        self._close_after = False
        """The request being served asked for ``Connection: close``."""
        self._body_deadline: float | None = None
        """When the body of the request whose head arrived must be in (loop time)."""
        self._head: tuple[int, CIMultiDictProxy[str], int, bool] | None = None
        """The head of the request whose body is awaited: where its body starts, its headers,
        ``Content-Length`` and ``Connection: close``."""
        self._head_at = 0.0
        """When that head arrived (``time.perf_counter``: the latency of a request the lane ends)."""
        self._write_paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.lanes.add(self)
        self._arm(self.idle_s, self._idle_close)

    def data_received(self, data: bytes) -> None:
        if self.task is None and not self.buffer and self._head is None and self._whole(data):
            return
        self.buffer += data
        if len(self.buffer) > self.max_buffer:  # pipelined past any one request: wait
            self.transport.pause_reading()
        if self.task is None:
            self._next()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head is not None and self._body_deadline is not None:  # it left while sending a body
            self._count("499")
        self._closing = True
        self.lanes.discard(self)
        self._stop_timer()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: as aiohttp's handler_cancellation, vLLM aborts

    def pause_writing(self) -> None:
        """The client reads slower than it is answered: take no further request (and read
        nothing more) until it catches up, as aiohttp's writer waits on a full buffer."""
        self._write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.transport is not None and not self._closing:
            self._read_on()
            if self.task is None:
                self._next()

    def _read_on(self) -> None:
        """Read from the client again unless its answers wait (write paused) or it sent past any
        one request (:attr:`max_buffer`) ahead of the one served: the lane never buffers more."""
        if not self._write_paused and len(self.buffer) <= self.max_buffer:
            self.transport.resume_reading()

    # -- one request at a time -------------------------------------------------------------

    def _next(self) -> None:
        """Take the next request in the buffer: serve it, wait for its body, or hand off."""
        self._disarm()
        if self._closing or self._write_paused:
            return
        if not self.buffer:
            self._arm(self.idle_s, self._idle_close)
            return
        if self._head is None:  # parsed once, however many reads its body takes
            end = self.buffer.find(b"\r\n\r\n", 0, self.max_head + 4)
            if end < 0:  # a head arriving in pieces, or too long: aiohttp's parser and timers judge it
                self._hand_off()
                return
            head = _parse_head(self.buffer, end, self.max_body)
            if head is None:
                self._hand_off()
                return
            self._head, self._head_at = (end + 4, *head), time.perf_counter()
        start, headers, length, close = self._head
        if len(self.buffer) < start + length:  # the rest of the body is on its way: one deadline from the head
            loop = asyncio.get_running_loop()
            if self._body_deadline is None:
                if not self.head_check(headers):  # a key the edge refuses: its answer now, not after the body
                    self._hand_off()
                    return
                self._body_deadline = loop.time() + self.body_s
            self._arm(self._body_deadline - loop.time(), self._body_late)
            return
        self._body_deadline = self._head = None
        with memoryview(self.buffer) as view:  # one copy, not two
            body = bytes(view[start:start + length])
        if not _lane_takes(body):
            self._hand_off()
            return
        del self.buffer[:start + length]
        self._start(FastRequest(self.app, headers, body, self), close)

    def _whole(self, data: bytes) -> bool:
        """Serve ``data`` when it is exactly one whole request the lane takes, read at once (most
        requests: a 4,000-token prompt is one read on loopback): its body is cut from ``data``
        without the buffer's copies. False leaves ``data`` to :meth:`_next`, which judges it
        by the same rules (and may hand it to aiohttp)."""
        if self._closing or self._write_paused:
            return False
        end = data.find(b"\r\n\r\n", 0, self.max_head + 4)
        head = _parse_head(data, end, self.max_body) if end >= 0 else None
        if head is None or len(data) != end + 4 + head[1]:
            return False
        body = data[end + 4:]
        if not _lane_takes(body):
            return False
        self._disarm()
        self._head_at = time.perf_counter()
        self._start(FastRequest(self.app, head[0], body, self), head[2])
        return True

    def _start(self, request: FastRequest, close: bool) -> None:
        self._close_after = close
        self.task = asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: FastRequest) -> None:
        try:
            resp = await self.handler(request)
        except asyncio.CancelledError:
            return  # the client left (counted 499 by the metrics middleware)
        except Exception:  # noqa: BLE001 - the error middleware answers everything inside it
            log.exception("fast lane: unexpected error serving %s", FAST_PATH)
            resp, self._close_after = _internal_error(), True
        finally:
            self.task = None
        if not request.answered and not isinstance(getattr(resp, "body", None), (bytes, bytearray)):
            log.error("fast lane: %s answered %r, which the lane cannot frame", FAST_PATH, resp)  # a bug
            resp, self._close_after = _internal_error(), True
        try:
            if not request.answered:
                request.answered = True
                self.write_response(resp)
        except ConnectionResetError:
            return
        except Exception:  # noqa: BLE001 - a bug in framing: the client sees the connection close, not a hang
            log.exception("fast lane: could not write the answer to %s", FAST_PATH)
            self.close()
            return
        if self._close_after:
            self.close()
        elif self.transport is not None and not self._closing:
            self._read_on()  # else resume_writing does, once the client reads
            self._next()

    def write_response(self, resp: web.Response, *, close: bool = False) -> None:
        """Write ``resp`` whole (``Connection: close`` when ``close`` or the request asked for
        it); ConnectionResetError when the connection is closed."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(encode_response(resp, close=close or self._close_after))

    # -- timers, hand-off, close -----------------------------------------------------------

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` in ``seconds`` unless disarmed or armed again first. The timer handle
        is kept across requests (idle deadlines only move later): a request re-arms with two
        assignments, not a handle cancelled and another scheduled."""
        loop = asyncio.get_running_loop()
        self._deadline, self._on_deadline = loop.time() + max(seconds, 0.0), callback
        if self._timer is not None and self._timer.when() <= self._deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(self._deadline, self._fire)

    def _disarm(self) -> None:
        self._on_deadline = None  # the handle stays: _fire finds nothing due

    def _fire(self) -> None:
        self._timer = None
        callback = self._on_deadline
        if callback is None or self._closing:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:  # armed again since: wait on
            self._timer = loop.call_at(self._deadline, self._fire)
            return
        self._on_deadline = None
        callback()

    def _stop_timer(self) -> None:
        """The connection is done with the lane: no deadline of it runs."""
        self._on_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_close(self) -> None:
        if self.task is None and not self.buffer:
            self.close()

    def _body_late(self) -> None:
        """The body did not arrive within ``router.body_timeout_s``: the edge's 408, then close."""
        if self.task is None:
            exc = body_late(self.body_s)
            self._count(str(exc.status))
            self._head = self._body_deadline = None
            try:
                self.write_response(error_response(exc.status, exc.message, param=exc.param), close=True)
            except ConnectionResetError:
                pass
            self.close()

    def _count(self, status: str) -> None:
        """Count a request the lane ended before the middlewares ran (``RouterMetrics.count_request``)."""
        self.app[keys.METRICS].count_request(ENDPOINT_PATHS[FAST_PATH], status, time.perf_counter() - self._head_at)

    def _hand_off(self) -> None:
        """aiohttp's protocol takes the connection from here, with the bytes not yet answered."""
        self._stop_timer()
        self.lanes.discard(self)
        transport, data = self.transport, bytes(self.buffer)
        self.buffer.clear()
        self.transport = None
        self._closing = True
        protocol = self.aiohttp_protocol()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        transport.resume_reading()
        if data:
            protocol.data_received(data)

    def close(self) -> None:
        """Close the connection (what is written still goes out)."""
        self._closing = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout_s: float = _CLOSE_SHUTDOWN_S) -> None:
        """Let a request still running finish (up to ``timeout_s``), then close."""
        task = self.task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout_s)
            task.cancel()
        self.close()


def _lane_takes(body: bytes) -> bool:
    """Whether the lane may take ``body``: a stream (``relay_stream``) is aiohttp's. The prompt's
    split (``router.token_ids.split_ids``, which the handler then reuses) says whether the body
    has a top-level ``"stream"`` member; a body it cannot split is screened on its bytes: no
    ``"stream"`` anywhere, and no key that could spell it with a ``\\u`` escape (memchr for the
    backslash first: CPython's two-byte search takes ~35 us on 20 KB)."""
    if not _utf8_json(body):
        return False
    split = split_ids(body, PROMPT_FIELD)
    if split is not None:
        return not split.streams
    return not (b'"stream"' in body or (b"\\" in body and b"\\u" in body))


_OTHER_ENCODINGS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


def _utf8_json(body: bytes) -> bool:
    """Whether ``json.loads`` would read ``body`` as UTF-8 without a BOM: it detects UTF-16 and
    UTF-32 by NUL bytes among the first four and by a BOM, and then the lane's byte screens would
    not see a ``"stream"`` key."""
    return not (b"\x00" in body[:4] or body.startswith(_OTHER_ENCODINGS))


_REQUEST_LINE = f"POST {FAST_PATH} HTTP/1.1"
_NAME = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
"""An HTTP field name (RFC 9110 token)."""
_VALUE = r"[\x20-\x7e\t]*"
"""A field value with the spaces and tabs around it: printable ASCII. One quantifier per line's
value, over characters the name and the line's end do not share: a hostile head cannot make
the pattern backtrack."""
_HEAD = re.compile(re.escape(_REQUEST_LINE) + rf"\r\n(?:{_NAME}:{_VALUE}\r\n)*")
_FIELDS = re.compile(rf"({_NAME}):({_VALUE})\r\n")


def _parse_head(data: bytes, end: int, max_body: int) -> tuple[CIMultiDictProxy[str], int, bool] | None:
    """``(headers, content_length, close)`` of the head ``data[:end]`` when the lane takes it
    (module doc); None otherwise. One pass in C (``cache_policy.native`` ``lane_head``), else
    :func:`_parse_head_py`, its reference."""
    if NATIVE is None:
        return _parse_head_py(data[:end], max_body)
    found = NATIVE.lane_head(data, end, min(max_body, _MAX_LENGTH))  # a C long long
    if found is None:
        return None
    pairs, length, close = found
    return CIMultiDictProxy(CIMultiDict(pairs)), length, close


def _parse_head_py(head: bytes, max_body: int) -> tuple[CIMultiDictProxy[str], int, bool] | None:
    """:func:`_parse_head` of ``head`` in Python: two C passes check the head's shape
    (:data:`_HEAD`) and cut its fields; Python looks only at the few names the lane judges."""
    try:
        text = head.decode("ascii") + "\r\n"
    except UnicodeDecodeError:
        return None
    if _HEAD.fullmatch(text) is None:
        return None  # obs-fold, a space before the colon, an odd name or byte: aiohttp's to refuse
    pairs: list[tuple[str, str]] = []
    length: int | None = None
    close = False
    seen: set[str] = set()
    for name, value in _FIELDS.findall(text, len(_REQUEST_LINE) + 2):
        value = value.strip(" \t")
        if "\t" in value:
            return None  # a tab inside a value: aiohttp's to judge
        lower = name.lower()
        if lower in _REFUSED_HEADERS:
            return None
        if lower == "content-length":
            if length is not None or not value.isdigit() or len(value) > 12:
                return None
            length = int(value)
        elif lower in ("host", "connection") and lower in seen:
            return None  # twice: aiohttp's to judge
        if lower == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            if "upgrade" in tokens:
                return None
            close = "close" in tokens
        seen.add(lower)
        pairs.append((name, value))
    if length is None or length > max_body or "host" not in seen:  # HTTP/1.1 needs a Host (aiohttp's 400)
        return None
    return CIMultiDictProxy(CIMultiDict(pairs)), length, close


def _internal_error() -> web.Response:
    return error_response(500, "internal error: the router logged it; please report it")


def chain(app: web.Application, handler: Handler) -> Handler:
    """``handler`` inside the app's middlewares, outermost first, as aiohttp calls them."""
    for middleware in reversed(app.middlewares):
        handler = functools.partial(middleware, handler=handler)
    return handler


async def serve_lane(app: web.Application, runner: web.AppRunner, handler: Handler, *, host: str, port: int,
                     sock: Any = None, max_head: int, max_body: int, idle_s: float, body_s: float,
                     head_check: Callable[[CIMultiDictProxy[str]], bool] = lambda _: True,
                     ) -> tuple[asyncio.AbstractServer, set[FastLane]]:
    """Listen on ``host:port`` (or ``sock``) with the lane in front of ``runner``'s aiohttp server;
    the server and the set of lane connections (:func:`close_lane` stops both)."""
    lanes: set[FastLane] = set()
    aiohttp_protocol = runner.server
    assert aiohttp_protocol is not None, "bug: serve_lane() before runner.setup()"
    chained = chain(app, handler)

    def factory() -> FastLane:
        return FastLane(app, chained, aiohttp_protocol, lanes, max_head=max_head, max_body=max_body,
                        idle_s=idle_s, body_s=body_s, head_check=head_check)

    loop = asyncio.get_running_loop()
    if sock is not None:
        server = await loop.create_server(factory, sock=sock)
    else:
        server = await loop.create_server(factory, host, port, reuse_address=True)
    return server, lanes


async def close_lane(server: asyncio.AbstractServer, lanes: set[FastLane]) -> None:
    """Stop listening, then let each lane connection's request finish (bounded) and close it."""
    server.close()
    await asyncio.gather(*(lane.shutdown() for lane in list(lanes)), return_exceptions=True)


__all__ = ["FAST_PATH", "FastLane", "FastRequest", "chain", "close_lane", "encode_head", "encode_response", "serve_lane"]
