"""The floor under the floor: a pass-through proxy on bare asyncio protocols, no HTTP framework.

``bench.h2h.passthrough`` measures what aiohttp and uvloop cost a proxy that does nothing; this
one measures what a Python proxy costs at all: uvloop, ``httptools`` parsing both sides, one
``transport.write`` per message, one kept-alive connection per upstream reused in turn. It
answers ``POST`` with the upstream's status and body and nothing else (no error handling past
closing the connection, no timeouts): a measuring stick for ``bench.h2h.ab``, never a server.

``--split`` adds the router's token-ID read of each body (``router.token_ids.split_ids``: the
prompt packed as uint32, the rest kept as bytes) and ``--core`` the decision core on top (one
replica: ``DecisionCore.open``, ``place``, ``admit`` before the send; ``settle`` right after it and
``finish`` after the answer, as the router runs them). The three rows in ``bench.h2h.ab`` split a
router's added latency into the Python floor, the token read, the decision and the rest (HTTP
semantics, validation, the lifecycle, the answer's annotation).

    python -m bench.h2h.bare --port 8100 http://127.0.0.1:8001 [--split | --core]
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop
from yarl import URL

from cache_policy.config import PolicyConfig
from cache_policy.core import DecisionCore, RequestSpec
from router.token_ids import split_ids


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
    def __init__(self, upstream: URL, idle: list[_Upstream], work: str | None, core: DecisionCore | None) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.upstream, self.idle, self.work, self.core = upstream, idle, work, core
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
        job = None
        if self.work is not None:
            split = split_ids(body, "prompt")
            if split is None:
                self.transport.close()  # not a token-ID prompt: outside this floor
                return
            if self.core is not None:
                now = loop.time()
                job = self.core.open(RequestSpec(split.ids, None, None, None, None, "generate", 1), now)
                self.core.place(job, now)
                if self.core.admit(job, now).verdict != "admit":
                    self.transport.close()
                    return
                loop.call_soon(self.core.settle)  # runs once the request is written, as in the router
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
            if job is not None:
                job.generated_tokens = 1
                loop.call_soon(self.core.finish, job, "ok", loop.time())
        except (ConnectionError, OSError):
            self.transport.close()
            return
        self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (status, len(answer)) + answer)


async def serve(port: int, upstream: str, work: str | None = None, core: DecisionCore | None = None) -> None:
    """Serve on ``127.0.0.1:port`` until cancelled; ``work``: None, ``"split"`` or ``"core"`` (see
    the module's docstring); ``core``: the decision core to run (default: one with a replica
    ``r0`` of 4,096 blocks of 16 tokens, as ``bench.h2h.ab``'s replica)."""
    idle: list[_Upstream] = []
    if work == "core" and core is None:
        core = DecisionCore(PolicyConfig())
        core.add_replica("r0", block_size=16, num_gpu_blocks=4096)  # bench.h2h.ab's replica
    server = await asyncio.get_running_loop().create_server(lambda: _Front(URL(upstream), idle, work, core),
                                                            "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.h2h.bare", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstream", help="the replica's base URL")
    work = p.add_mutually_exclusive_group()
    work.add_argument("--split", dest="work", action="store_const", const="split",
                      help="read each token-ID prompt as the router does")
    work.add_argument("--core", dest="work", action="store_const", const="core",
                      help="read it and run the decision core on it (open, place, admit)")
    args = p.parse_args(argv)
    try:
        uvloop.run(serve(args.port, args.upstream.rstrip("/"), args.work))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
