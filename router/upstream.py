"""ReplicaClient: non-streamed requests to replicas on pooled keep-alive HTTP/1.1 connections.

Every completion the router answers whole, and every row of a scoring fan-out (K requests per
``/v1/score``), is one POST of a JSON body to a replica and one JSON answer back. aiohttp's
client spends about 0.23 ms of CPU on each (``bench.h2h.ab`` beside an aiohttp server with a
bare protocol client: 0.45 vs 0.68 ms per proxied request on this machine); here a request is
one ``transport.write`` of the head and body, and the answer is parsed by ``httptools`` (the
llhttp parser uvicorn runs; vLLM answers with ``Content-Length`` or chunked bodies, both parsed).
Streams stay on aiohttp (``router.proxy.relay_stream``), which relays them event by event.

Failure contract (what ``router.proxy.post_json`` and the lifecycle rely on):

* nobody listens (connection refused): ``ReplicaUnreachable(refused=True)``; no connection within
  ``connect_timeout_s``: ``ReplicaUnreachable``;
* the connection closes before any byte of the answer (a keep-alive connection the server had
  closed, a reset): once more on a fresh connection, then ``ReplicaUnreachable``;
* it closes mid-answer, or the answer is not HTTP: ``ReplicaUnreachable`` (never a partial body);
* no whole answer within ``timeout_s``: ``asyncio.TimeoutError``;
* the caller is cancelled (its client went away, a weight update took the request back): the
  connection is closed, so vLLM aborts the request and frees its KV cache
  (``vllm/entrypoints/utils.py`` ``with_cancellation``).

A connection goes back to the pool only after a whole answer that keeps it alive, and is
dropped once idle ``idle_s`` (vLLM's server closes idle connections after 5 s; reusing one just
as it closes would cost a retry).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

import httptools
from yarl import URL

from replicas.auth import PROCESS_KEYS, ReplicaAuth, bearer, origin

log = logging.getLogger(__name__)


class ReplicaUnreachable(Exception):
    """Connecting or talking to the replica failed before any byte reached the client.

    ``refused``: nobody listens at its address (connection refused): it is down, not flaky."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamLost(Exception):
    """The connection ended (or the answer was not HTTP) before a whole answer arrived;
    ``received``: whether any byte of the answer had (then it is not retried)."""

    def __init__(self, message: str, received: bool) -> None:
        super().__init__(message)
        self.received = received


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request at a time (no pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.received = False
        self.idle_since = 0.0
        self._body: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        """Fails the request in flight at its deadline (``send``)."""
        self._on_answer: Callable[[int, bytes], object] | None = None
        """Called with the request's whole answer before its future resolves (``send``)."""

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamLost(f"the replica's answer is not HTTP: {exc}", True))
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(UpstreamLost(f"connection closed{f' ({exc!r})' if exc else ''}", self.received))

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self.waiter is None:  # a second answer in one read: the server does not follow HTTP/1.1
            self.close()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # informational (100 Continue, 103): the answer follows
            self._body = []
            return
        on_answer = self._on_answer
        waiter = self._take_waiter()
        answer = (status, b"".join(self._body))
        self._body = []
        if not self.parser.should_keep_alive():
            self.close()
        if waiter is not None and not waiter.done():
            if on_answer is not None:
                try:
                    on_answer(*answer)
                except Exception:  # noqa: BLE001 - its caller still gets the answer, by the future
                    log.exception("replica client: the answer callback failed; the request's task takes the answer")
            waiter.set_result(answer)

    # -- use --
    def send(self, data: Sequence[bytes], deadline: float,
             on_answer: Callable[[int, bytes], object] | None = None) -> asyncio.Future[tuple[int, bytes]]:
        """Write one whole request, its pieces one after another; the future resolves to
        ``(status, body)``, or fails with UpstreamLost, or with TimeoutError at ``deadline``
        (loop time: the connection is then closed, so the replica aborts the request). One
        timer handle per request, not an ``asyncio.timeout`` context (``bench.h2h.ab``).
        ``on_answer(status, body)``: called with a whole answer as it is read, before the
        future resolves (an exception from it is logged, the future resolves all the same)."""
        assert self.waiter is None and self.transport is not None, "bug: a request on a busy connection"
        self.received, self._body = False, []
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        if self.closed or self.transport.is_closing():  # closed by the server since it was pooled
            waiter.set_exception(UpstreamLost("connection closed before the request", False))
            return waiter
        self.waiter, self._on_answer = waiter, on_answer
        try:
            self.transport.writelines(data)  # uvloop: one writev, the pieces not joined
        except (OSError, RuntimeError) as exc:  # a transport that broke under the write
            self.waiter = self._on_answer = None
            waiter.set_exception(UpstreamLost(f"write failed ({exc!r})", False))
            return waiter
        self._timer = loop.call_at(deadline, self._time_out)
        return waiter

    def _time_out(self) -> None:
        self._timer = None
        waiter = self._take_waiter()
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError("the replica did not answer in time"))
        self.close()

    def _take_waiter(self) -> asyncio.Future[tuple[int, bytes]] | None:
        """The request's future, now no longer the connection's; its deadline disarmed."""
        waiter, self.waiter, self._on_answer = self.waiter, None, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: UpstreamLost) -> None:
        waiter = self._take_waiter()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


def _refused(exc: OSError) -> bool:
    """Whether connecting failed because nobody listens: ECONNREFUSED, or (a name with several
    addresses, ``localhost``) asyncio's "Multiple exceptions" OSError when every address refused."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    text = str(exc)
    return exc.errno is None and text.startswith("Multiple exceptions") and text.count("[Errno 111]") == text.count("[Errno")


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, int, bytes, str]:
    """``(host, port, request line with the Host and Content-Type headers, origin)`` of ``url``
    (each replica's few paths, once); ``origin`` as ``replicas.auth`` spells it, its key's name."""
    parsed = URL(url)
    if parsed.scheme != "http" or not parsed.host:
        raise ValueError(f"replica URLs are plain http://host:port/...: got {url!r}")
    port = parsed.port or 80
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    path = parsed.raw_path_qs or "/"
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
    return parsed.host, port, head, origin(url)


class ReplicaClient:
    """POSTs to replicas on pooled keep-alive connections (one pool per ``host:port``).

    ``timeout_s``: a whole request, answer included (``router.request_timeout_s``);
    ``connect_timeout_s``: opening a connection; ``idle_s``: how long a pooled connection may
    wait for its next request; ``auth``: each replica's key, sent as a bearer token
    (``replicas.auth``; the process-wide ``PROCESS_KEYS`` by default, as the router's aiohttp
    session sends them). Event-loop only."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 5.0, idle_s: float = 3.0,
                 auth: ReplicaAuth | None = None) -> None:
        self.auth = PROCESS_KEYS if auth is None else auth
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def post(self, url: str, data: bytes | Sequence[bytes],
                   on_answer: Callable[[int, bytes], object] | None = None) -> tuple[int, bytes]:
        """POST the JSON ``data`` (bytes, or its pieces in order) to ``url`` (with the replica's key,
        if it has one); ``(status, body)``. Raises ReplicaUnreachable or asyncio.TimeoutError
        (module docstring). ``on_answer(status, body)``: called with the whole answer as soon as
        it is read, before this coroutine resumes (its exceptions are logged, not raised)."""
        host, port, head, name = _target(url)
        key = self.auth.key(name)
        auth = b"" if key is None else "".join(f"{k}: {v}\r\n" for k, v in bearer(key).items()).encode()
        parts = (data,) if isinstance(data, (bytes, bytearray)) else tuple(data)
        request = (b"%s%sContent-Length: %d\r\n\r\n" % (head, auth, sum(map(len, parts))), *parts)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        for attempt in (1, 2):
            conn = await self._acquire(host, port, url, deadline)
            try:
                answer = await conn.send(request, deadline, on_answer)
            except UpstreamLost as exc:
                conn.close()
                if exc.received:
                    raise ReplicaUnreachable(f"{url}: {exc} in the middle of the answer") from exc
                if attempt == 2:
                    raise ReplicaUnreachable(f"{url}: {exc} (twice, on a fresh connection too)") from exc
                log.info("stale connection to %s (%s): once more on a fresh one", url, exc)
                continue
            except BaseException:  # cancelled or timed out: drop it, so vLLM aborts the request
                conn.close()
                raise
            self._release(host, port, conn)
            return answer
        raise AssertionError("unreachable")

    async def _acquire(self, host: str, port: int, url: str, deadline: float) -> _Connection:
        """A pooled connection still fit for a request, else a new one (within
        ``connect_timeout_s`` and before ``deadline``, loop time: else TimeoutError)."""
        if self._closed:
            raise ReplicaUnreachable(f"{url}: the router's replica client is closed")
        idle = self._idle.get((host, port))
        loop = asyncio.get_running_loop()
        while idle:
            conn = idle.pop()
            if self._reusable(conn, loop.time()):
                return conn
            conn.close()
        if loop.time() >= deadline:
            raise TimeoutError(f"{url}: no time left to connect")
        try:
            async with asyncio.timeout(min(self.connect_timeout_s, deadline - loop.time())):
                _, conn = await loop.create_connection(_Connection, host, port)
        except OSError as exc:
            if _refused(exc):
                raise ReplicaUnreachable(f"{url}: connection refused ({exc})", refused=True) from exc
            raise ReplicaUnreachable(f"{url}: cannot connect ({exc!r})") from exc
        except TimeoutError as exc:
            raise ReplicaUnreachable(f"{url}: cannot connect ({exc!r})") from exc
        return conn

    def _release(self, host: str, port: int, conn: _Connection) -> None:
        if conn.closed or self._closed:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle = self._idle.setdefault((host, port), [])
        idle.append(conn)
        if len(idle) > 64:  # after a burst: forget the ones already closed or expired
            fresh = []
            for c in idle:
                if self._reusable(c, conn.idle_since):
                    fresh.append(c)
                else:
                    c.close()
            idle[:] = fresh

    def _reusable(self, conn: _Connection, now: float) -> bool:
        """Whether a pooled ``conn`` may take a request at ``now`` (loop time): open, and idle
        less than ``idle_s``."""
        return not conn.closed and now - conn.idle_since < self.idle_s

    def idle_connections(self) -> int:
        """Pooled connections open now (for tests and metrics)."""
        return sum(1 for conns in self._idle.values() for c in conns if not c.closed)

    async def close(self) -> None:
        """Close every pooled connection; later posts raise ReplicaUnreachable."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing

