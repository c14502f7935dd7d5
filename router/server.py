"""Run a router app on a loopback port, with the replicas it fronts.

`running_router` serves an app on ``cfg.router.port`` (0 = a free port) and yields its base
URL; the CLI's ``serve`` and ``demo`` and the tests use it. Client disconnects cancel the
handler (``handler_cancellation=True``) so upstream requests are aborted. Every app served here
can be drained (``router.shutdown``: ``app[SHUTDOWN]``, ``drain(app, grace_s)``).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Sequence

from aiohttp import web

from replicas.replica_set import ReplicaEndpoint
from replicas.server import resolve_model
from router.app import create_app
from router.fleet import attach_fleet
from router.config import AppConfig
from router.shutdown import install as install_shutdown
from router.tokenize import PromptTokenizer


def tokenizer_path(cfg: AppConfig) -> str:
    """The router's tokenizer: ``router.tokenizer`` or the replicas' model (generated if 'tiny')."""
    if cfg.router.tokenizer:
        return cfg.router.tokenizer
    return resolve_model(cfg.replicas)


@contextlib.asynccontextmanager
async def running_router(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint],
                         tokenizer: PromptTokenizer | None = None,
                         replica_set=None) -> AsyncIterator[tuple[str, web.Application]]:
    """Serve a router for ``endpoints``; yield ``(base_url, app)``; shut down on exit.

    ``replica_set``: the ``ReplicaSet`` behind the endpoints, if any: the router follows its
    events (restarts, new URLs, drains) and serves ``/admin/replicas`` for it."""
    tokenizer = tokenizer or PromptTokenizer(tokenizer_path(cfg))
    app = create_app(cfg, endpoints, tokenizer)
    attach_fleet(app, replica_set)
    install_shutdown(app)
    r = cfg.router  # header limits and the keep-alive timer, which also bounds slow headers
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           max_line_size=r.max_header_bytes, max_field_size=r.max_header_bytes,
                           keepalive_timeout=r.header_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.router.host, cfg.router.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{cfg.router.host}:{port}", app
    finally:
        await runner.cleanup()


__all__ = ["running_router", "tokenizer_path"]
