"""The floor under the floor: a pass-through proxy on bare asyncio protocols, no HTTP framework.

``bench.h2h.passthrough`` measures what aiohttp and uvloop cost a proxy that does nothing; this
one measures what a Python proxy costs at all: uvloop, ``httptools`` parsing both sides, one
``transport.write`` per message, one kept-alive connection per upstream reused in turn. It
answers ``POST`` with the upstream's status and body and nothing else (no error handling past
closing the connection, no timeouts): a measuring stick for ``bench.h2h.ab``, never a server.

    python -m bench.h2h.bare --port 8100 http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop
from yarl import URL


class _Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("upstream closed"))


class _Front(asyncio.Protocol):
    def __init__(self, upstream: URL, idle: list[_Upstream]) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.upstream, self.idle = upstream, idle
        self.transport: asyncio.Transport | None = None
        self.url = b"/"
        self.body: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self._forward(self.url, body))

    async def _forward(self, url: bytes, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.idle:
                up = self.idle.pop()
            else:
                _, up = await loop.create_connection(_Upstream, self.upstream.host, self.upstream.port)
            up.waiter = loop.create_future()
            up.transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % (url, self.upstream.host.encode(), len(body)) + body)
            status, answer = await up.waiter
            self.idle.append(up)
        except (ConnectionError, OSError):
            self.transport.close()
            return
        self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (status, len(answer)) + answer)


async def serve(port: int, upstream: str) -> None:
    """Serve on ``127.0.0.1:port`` until cancelled."""
    idle: list[_Upstream] = []
    server = await asyncio.get_running_loop().create_server(lambda: _Front(URL(upstream), idle), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.h2h.bare", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstream", help="the replica's base URL")
    args = p.parse_args(argv)
    try:
        uvloop.run(serve(args.port, args.upstream.rstrip("/")))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
