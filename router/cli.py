"""``rollout-router``: ``serve`` (replicas + router). The demo (the main job) is ``bench.demo_cli``:
the router never imports ``bench/``.

Flags are generated from the config dataclasses, so every default is written once:
``--port`` overrides ``router.port`` and so on; ``--config`` names a YAML file.
"""

from __future__ import annotations

import argparse
import re
import asyncio
import gc
import dataclasses
import json
import logging
import signal
import socket
import sys
import typing
from collections.abc import Callable
from typing import Any

from replicas.config import StartupError
from cache_policy.config import PolicyConfig
from router import package_version
from router.config import AppConfig, RouterConfig

_SIMPLE = (int, float, str)


BOOL_METAVAR = "{true,false}"
"""How --help shows a boolean flag's value (yes/no, on/off and 1/0 are taken too)."""


def _bool(text: str) -> bool:
    """argparse type for boolean fields: true/false, yes/no, on/off, 1/0."""
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _api_keys(text: str) -> dict[str, str | None]:
    """argparse type for ``--api-keys``: ``KEY=TENANT`` pairs separated by commas (a bare
    ``KEY`` acts for no tenant), or a JSON object ``{"KEY": "TENANT" or null}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if not isinstance(value, dict) or not all(isinstance(v, str) or v is None for v in value.values()):
            raise argparse.ArgumentTypeError('expected {"KEY": "TENANT" or null, ...}')
        return value
    out: dict[str, str | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, tenant = item.partition("=")
        if not key.strip() or (sep and not tenant.strip()):
            raise argparse.ArgumentTypeError(f"expected KEY=TENANT or KEY, got {item!r}")
        out[key.strip()] = tenant.strip() if sep else None
    return out


def _choices(cls: type, f: dataclasses.Field) -> tuple[str, ...] | None:
    """The values of a Literal-typed field (``Literal[...]`` or ``Literal[...] | None``), else None."""
    hint = typing.get_type_hints(cls)[f.name]
    for t in (hint, *typing.get_args(hint)):
        if typing.get_origin(t) is typing.Literal:
            return tuple(str(v) for v in typing.get_args(t))
    return None


def _flag_type(cls: type, f: dataclasses.Field) -> type | None:
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) is typing.Literal:
        return str
    if typing.get_origin(hint) is dict:  # (its type arguments are the key's and value's, not a union)
        return _api_keys if f.name == "api_keys" else None
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = typing.get_origin(args[0]) or args[0]
    if base is typing.Literal:
        return str
    if base is bool:
        return _bool
    return base if base in _SIMPLE else None


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                        skip: frozenset[str] = frozenset()) -> None:
    """One ``--name`` flag per simple field of ``cls`` not in ``skip`` (defaults from the dataclass;
    help from the field's docstring, as plain text: see :func:`_plain`)."""
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        kind = _flag_type(cls, f)
        if kind is None or f.name in skip:
            continue
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        choices = _choices(cls, f)
        # a Literal's values show as {a,b} (checked by the config, whose error names the YAML path)
        metavar = (BOOL_METAVAR if kind is _bool else "KEY=TENANT,..." if kind is _api_keys
                   else "{" + ",".join(choices) + "}" if choices else None)
        group.add_argument(f"--{prefix}{f.name}".replace("_", "-"), dest=f"{prefix}{f.name}".replace("-", "_"), type=kind,
                           default=None, metavar=metavar,
                           help=f"{_doc(cls, f.name)}(default: {default})")


def _doc(cls: type, name: str) -> str:
    """The docstring line under a dataclass field, read from the source (empty if none)."""
    import inspect

    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return ""
    for i, line in enumerate(lines[:-1]):
        if line.strip().startswith(f"{name}:") and lines[i + 1].strip().startswith('"""'):
            parts = []
            for doc_line in lines[i + 1:]:
                parts.append(doc_line.strip().strip('"').strip())
                if doc_line.rstrip().endswith('"""') and (len(parts) > 1 or doc_line.strip().count('"""') == 2):
                    break
            return _plain(" ".join(p for p in parts if p)) + " "
    return ""


_SOURCE_REF = re.compile(r" \((?:DESIGN rule \d+|seed \d+[^)]*)\)")
"""Spec references such as " (DESIGN rule 3)" or " (seed 003)": kept in docstrings, left out of --help."""
_RST_LITERAL = re.compile(r"``(.+?)``")
"""reStructuredText inline literals (two backticks each side): plain text in --help."""


def _plain(doc: str) -> str:
    """A field docstring as --help shows it: spec references left out, and an inline literal
    (a name between double backticks) written as the bare name."""
    return _RST_LITERAL.sub(r"\1", _SOURCE_REF.sub("", doc))


def dataclass_overrides(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    dest = prefix.replace("-", "_")
    return {f.name: getattr(args, f"{dest}{f.name}") for f in dataclasses.fields(cls)
            if getattr(args, f"{dest}{f.name}", None) is not None}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-router",
        description="Prefix-cache-aware router for RL rollouts and OPD scoring in front of vLLM replicas.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the replicas and serve the router until interrupted")
    for p in (serve,):
        p.add_argument("--config", default=None, help="YAML config (sections router, replicas, policy); the router and policy fields are also flags below")
        p.add_argument("--num-replicas", type=int, default=None, help="override replicas.num_replicas")
        p.add_argument("--log-level", default="WARNING", help="DEBUG | INFO | WARNING | ERROR (default: WARNING)")
    add_dataclass_flags(serve, RouterConfig)
    add_dataclass_flags(serve, PolicyConfig, "policy-")
    from router.state.status import add_status_parser

    add_status_parser(sub)
    return parser


def _config(args: argparse.Namespace) -> AppConfig:
    cfg = AppConfig.load(args.config)
    return cfg.replace(router=dataclass_overrides(args, RouterConfig), replicas=_replica_overrides(args),
                       policy=dataclass_overrides(args, PolicyConfig, "policy-"))


def _replica_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--num-replicas``, when given: at least 1 (ValueError naming the flag otherwise; 0 used to
    be dropped silently, so the config's count started)."""
    if args.num_replicas is None:
        return {}
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas: must be >= 1, got {args.num_replicas}")
    return {"num_replicas": args.num_replicas}


def _reserve_port(host: str, port: int) -> socket.socket:
    """The router's listening address, bound before any replica starts and held until the router
    serves on it (``running_router(sock=...)``), so no other process can take it during the
    minutes replicas take to start; bound but not listening, it refuses connections meanwhile.
    OSError naming the port when it is taken (or the host cannot be bound)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"router.host {host!r} cannot be bound ({exc.strerror})") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's TCPSite does
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(f"router.port {port} on {host} is not free ({exc.strerror}); pick another --port") from exc
    return sock


async def _serve(cfg: AppConfig, sock: socket.socket) -> None:
    """Replicas, then the router, until SIGINT or SIGTERM; then a graceful stop, in order:
    new and queued requests get 503 + Retry-After, in-flight ones get ``router.shutdown_grace_s``
    to finish (a second signal cuts that short), the router stops, then the replicas
    (supervision first, then each replica's whole process group), and this returns (exit 0)."""
    from replicas.replica_set import ReplicaSet
    from router.server import running_router
    from router.shutdown import SHUTDOWN, drain

    signals = _Signals(asyncio.get_running_loop())
    # progress on stderr: stdout's first line stays the "serving ... at URL" banner scripts wait for
    if cfg.replicas.urls:
        print(f"rollout-router: checking {len(cfg.replicas.urls)} vLLM server(s) ...", file=sys.stderr, flush=True)
    else:
        print(f"rollout-router: starting {cfg.replicas.num_replicas} vLLM replica(s) of {cfg.replicas.model} "
              "(about a minute or two on CPU) ...", file=sys.stderr, flush=True)
    async with ReplicaSet(cfg.replicas) as replica_set:
        signals.install()  # again: starting Ray may have replaced the handlers
        async with running_router(cfg, replica_set.endpoints, replica_set=replica_set, sock=sock) as (url, app):
            signals.on_first = app[SHUTDOWN].refuse_new
            print(f"rollout-router serving {len(replica_set.endpoints)} replica(s) at {url} "
                  f"(policy {cfg.router.policy}); Ctrl-C or SIGTERM stops", flush=True)
            _steady_gc()
            await signals.first.wait()
            print(f"rollout-router: draining (in-flight requests get {cfg.router.shutdown_grace_s:g} s; "
                  "a second signal cuts that short) ...", flush=True)
            draining = asyncio.ensure_future(drain(app, cfg.router.shutdown_grace_s))
            hurry = asyncio.ensure_future(signals.second.wait())
            await asyncio.wait({draining, hurry}, return_when=asyncio.FIRST_COMPLETED)
            hurry.cancel()
            draining.cancel()
        print("rollout-router: router stopped" + ("" if cfg.replicas.urls else "; stopping the replicas ..."), flush=True)
    print("rollout-router: stopped", flush=True)


GC_THRESHOLD = (10_000, 20, 20)
"""The cyclic collector's thresholds once the router serves (CPython's default: 700, 10, 10)."""


def _steady_gc() -> None:
    """Once started, the router's objects from startup (modules, the tokenizer, pydantic's schemas)
    live as long as it does: they leave the cyclic collector's passes (``gc.freeze``), and young
    objects are collected every 10,000 allocations, not 700 (a request makes a few hundred that die
    with it). ``bench.h2h.ab``, this vs the defaults, one run: added p50 +2.05 vs +2.17 ms."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


class _Signals:
    """SIGINT/SIGTERM as two events: the first signal, and any signal after it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.first, self.second = loop, asyncio.Event(), asyncio.Event()
        self.on_first: Callable[[], None] | None = None
        """Called inside the signal's own callback, before any other task runs (the router's
        ``Shutdown.refuse_new``)."""
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if not self.first.is_set() and self.on_first is not None:
            self.on_first()
        (self.second if self.first.is_set() else self.first).set()


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event-loop factory for ``router.event_loop`` (None: asyncio's default)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":  # the routers sharing one Redis (router.state.status)
        from router.state.status import run_status

        return run_status(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _config(args)
        sock = _reserve_port(cfg.router.host, cfg.router.port) if args.command == "serve" else None
    except (ValueError, OSError) as exc:
        print(f"rollout-router: config error: {exc}", file=sys.stderr)
        return 2
    try:
        if sock is not None:
            with sock, asyncio.Runner(loop_factory=_loop_factory(cfg.router.event_loop)) as runner:
                runner.run(_serve(cfg, sock))
    except KeyboardInterrupt:
        return 130
    except StartupError as exc:  # replicas unusable as found (unreachable, block sizes differ, no tokenizer)
        print(f"rollout-router: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
