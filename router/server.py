"""Run a router app on a loopback port, with the replicas it fronts.

`running_router` serves an app on ``cfg.router.port`` (0 = a free port) and yields its base
URL; the CLI's ``serve`` and ``demo`` and the tests use it. Client disconnects cancel the
handler (``handler_cancellation=True``) so upstream requests are aborted. Every app served here
can be drained (``router.shutdown``: ``app[SHUTDOWN]``, ``drain(app, grace_s)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import AsyncIterator, Sequence

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from replicas.addresses import host_key
from replicas.config import StartupError
from replicas.replica_set import ReplicaEndpoint
from replicas.served_model import model_source
from router import keys
from router.app import create_app
from router.config import AppConfig
from router.fleet import attach_fleet
from router.edge import head_check
from router.fastlane import close_lane, serve_lane
from router.shutdown import install as install_shutdown
from router.tokenize import PromptTokenizer

log = logging.getLogger(__name__)


def tokenizer_path(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint] = ()) -> str | None:
    """Where the router's tokenizer comes from: ``router.tokenizer``; else, with ``replicas.urls``,
    the served model's folder when a server's ``/v1/models`` ``root`` is one on this machine
    (else None: no tokenizer); else the launched replicas' model (generated if 'tiny')."""
    if cfg.router.tokenizer:
        return cfg.router.tokenizer
    return model_source(cfg.replicas, [e.model_root for e in endpoints])


async def load_tokenizer(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint] = ()) -> PromptTokenizer:
    """The router's tokenizer (:func:`tokenizer_path`), loaded off the event loop.

    StartupError when ``router.tokenizer`` cannot be loaded; a served model's folder without a
    usable tokenizer only means no tokenizer (a warning): token-ID prompts still work."""
    path = await asyncio.to_thread(tokenizer_path, cfg, endpoints)
    tokenizer = PromptTokenizer(path)
    try:
        await asyncio.to_thread(tokenizer.load)
    except (OSError, ValueError) as exc:
        if cfg.router.tokenizer or not cfg.replicas.urls:
            source = "router.tokenizer" if cfg.router.tokenizer else "the replicas' model"
            raise StartupError(f"{source} {path!r} has no tokenizer that loads: {' '.join(str(exc).split())}") from None
        log.warning("no tokenizer in the served model's folder %s (%s); text prompts get 400 until "
                    "router.tokenizer is set", path, exc)
        return PromptTokenizer(None)
    if path is None:
        log.warning("no tokenizer (router.tokenizer unset, and no server names a local model folder): "
                    "token-ID prompts only; text prompts and chat messages get 400")
    return tokenizer


class _BadHttpQuiet(logging.Filter):
    """aiohttp logs each malformed request it refuses (a 400 before any handler runs: bad
    framing, a header too long) at ERROR with a traceback, so a client could fill the log at
    will: such records go out as one DEBUG line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg, record.args = "%s: refused a malformed request: %r", (record.getMessage(), exc)
            record.exc_info, record.exc_text = None, None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_QUIET = _BadHttpQuiet()


@contextlib.asynccontextmanager
async def running_router(cfg: AppConfig, endpoints: Sequence[ReplicaEndpoint],
                         tokenizer: PromptTokenizer | None = None,
                         replica_set=None, sock: socket.socket | None = None,
                         ) -> AsyncIterator[tuple[str, web.Application]]:
    """Serve a router for ``endpoints``; yield ``(base_url, app)``; shut down on exit.

    ``replica_set``: the ``ReplicaSet`` behind the endpoints, if any: the router follows its
    events (restarts, new URLs, drains) and serves ``/admin/replicas`` for it. ``sock``: a bound
    socket to listen on (``serve`` binds it before starting replicas); None binds
    ``router.host:router.port`` now."""
    tokenizer = tokenizer or await load_tokenizer(cfg, endpoints)
    await asyncio.to_thread(tokenizer.load)  # a given one too: never first loaded on the event loop
    app = create_app(cfg, endpoints, tokenizer)
    attach_fleet(app, replica_set)
    install_shutdown(app)
    server_log = logging.getLogger("aiohttp.server")
    if _QUIET not in server_log.filters:
        server_log.addFilter(_QUIET)
    r = cfg.router  # header limits and the keep-alive timer, which also bounds slow headers
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           max_line_size=r.max_header_bytes, max_field_size=r.max_header_bytes,
                           keepalive_timeout=r.header_timeout_s,
                           auto_decompress=False)  # the edge undoes Content-Encoding (router.content_encoding)
    await runner.setup()
    lane = None
    try:
        if r.fast_lane:  # plain completions on a bare protocol, the rest handed to aiohttp
            lane = await serve_lane(app, runner, app[keys.FAST_HANDLER], host=r.host, port=r.port, sock=sock,
                                    max_head=r.max_header_bytes, max_body=r.max_body_bytes,
                                    idle_s=r.header_timeout_s, body_s=r.body_timeout_s, head_check=head_check(cfg))
            sockets = lane[0].sockets
        else:
            site = web.TCPSite(runner, r.host, r.port) if sock is None else web.SockSite(runner, sock)
            await site.start()
            sockets = site._server.sockets  # type: ignore[union-attr]
    except BaseException:
        await runner.cleanup()
        raise
    port = sockets[0].getsockname()[1]
    for listening in sockets:
        ip, own_port = listening.getsockname()[:2]
        app[keys.OWN_ADDRESSES].update({(ip, own_port), (host_key(ip), own_port)})
    host = r.host if ":" not in r.host else f"[{r.host}]"
    shared = app[keys.LIFECYCLE].shared if keys.LIFECYCLE in app else None
    if shared is not None:  # what the other routers show and name (a commit sent to the wrong one)
        reachable = socket.gethostname() if r.host in ("0.0.0.0", "::", "") else host
        shared.address = f"http://{reachable}:{port}"
    try:
        yield f"http://{host}:{port}", app
    finally:
        if lane is not None:
            await close_lane(*lane)
        await _bounded_cleanup(runner)


CLEANUP_TIMEOUT_S = 20.0
"""How long stopping the app (handlers, then cleanup contexts) may take before it is left behind."""


async def _bounded_cleanup(runner: web.AppRunner) -> None:
    """``runner.cleanup()``, but a cleanup context that ignores cancellation cannot hold the
    shutdown forever: after ``CLEANUP_TIMEOUT_S`` it is left running and logged."""
    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=CLEANUP_TIMEOUT_S)
    if done:
        cleanup.result()
        return
    here = asyncio.current_task()
    pending = sorted({getattr(t.get_coro(), "__qualname__", t.get_name())  # what runs, not "Task-123"
                      for t in asyncio.all_tasks() if not t.done() and t is not here and t is not cleanup})
    log.error("router cleanup still running after %g s (stuck tasks: %s); going on", CLEANUP_TIMEOUT_S, pending)


__all__ = ["load_tokenizer", "running_router", "tokenizer_path"]
