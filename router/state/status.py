"""``rollout-router status --redis-url URL``: the routers sharing one Redis and where they disagree.

Reads what each live router wrote in its last sync round (``router:<id>``, see
``router.state.peers``) and the version snapshot in Redis. Exit status: 0 all agree, 1 some
disagreement, 2 Redis unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from router.config import RouterConfig

_DEFAULTS = RouterConfig()


def add_status_parser(sub) -> None:
    """The ``status`` subcommand's flags."""
    p = sub.add_parser("status", help="routers sharing one Redis: alive, their view of versions and replicas, "
                                      "and any disagreement")
    p.add_argument("--redis-url", required=True, help="the Redis the routers share (router.redis_url)")
    p.add_argument("--redis-prefix", default=_DEFAULTS.redis_prefix, help="router.redis_prefix (default: %(default)s)")
    p.add_argument("--alive-s", type=float, default=max(1.0, 4 * _DEFAULTS.state_sync_interval_s),
                   help="a router whose last heartbeat is older is not alive (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="deadline of each Redis call (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def disagreements(views: list[dict[str, Any]], redis_epoch: int | None) -> list[str]:
    """What the routers' views disagree on: version epoch, current version, policy, and per
    replica its presence, URL, loaded version and rotation. Empty when they all agree."""
    out = []
    for name in ("epoch", "current_version", "policy", "versions_confirmed"):
        values = {json.dumps(v.get(name)) for v in views}
        if len(values) > 1:
            out.append(f"{name}: " + ", ".join(f"{v['router']}={v.get(name)}" for v in views))
    if redis_epoch is not None:
        behind = [v["router"] for v in views if v.get("epoch") != redis_epoch]
        if behind:
            out.append(f"epoch in redis is {redis_epoch}; not applied yet by {', '.join(behind)}")
    replicas = sorted({rid for v in views for rid in v.get("replicas", {})})
    for rid in replicas:
        for field in ("present", "url", "version", "rotation"):
            seen = {}
            for v in views:
                entry = v.get("replicas", {}).get(rid)
                seen[v["router"]] = entry is not None if field == "present" else (entry or {}).get(field)
            if len({json.dumps(x) for x in seen.values()}) > 1:
                out.append(f"{rid} {field}: " + ", ".join(f"{r}={x}" for r, x in seen.items()))
    return out


async def collect(url: str, prefix: str, alive_s: float, timeout_s: float) -> dict[str, Any]:
    """Live routers' views, the epoch in Redis, the update lock holder. Raises StateUnavailable."""
    from router.state.peers import read_status
    from router.state.redis_client import GuardedRedis
    from router.state.wire import Keys

    redis = GuardedRedis(url, timeout_s=timeout_s, failures=1)
    keys = Keys(prefix)
    try:
        views = await read_status(redis, keys, alive_s)
        epoch, lock = await redis.call(lambda c: c.mget([keys.versions_epoch, keys.lock_update]))
    finally:
        await redis.close()
    redis_epoch = None if epoch is None else int(epoch)
    return {"redis": url, "prefix": prefix, "routers": views, "redis_epoch": redis_epoch, "update_lock": lock,
            "disagreements": disagreements(views, redis_epoch)}


def render(report: dict[str, Any]) -> str:
    """The report as text: one line per router, then the disagreements."""
    now = time.time()
    lines = [f"{len(report['routers'])} router(s) alive on {report['redis']} (prefix {report['prefix']!r}); "
             f"version epoch in redis: {report['redis_epoch']}; update lock: {report['update_lock'] or 'free'}"]
    for v in sorted(report["routers"], key=lambda v: v["router"]):
        reps = " ".join(f"{rid}=v{r.get('version')}{'' if r.get('healthy') else '(unhealthy)'}"
                        f"{'(' + r['rotation'] + ')' if r.get('rotation') else ''}[{r.get('in_flight', 0)}]"
                        for rid, r in sorted(v.get("replicas", {}).items()))
        lines.append(f"  {v['router']}  seen {now - v.get('time', now):.1f}s ago  epoch {v.get('epoch')}  "
                     f"current v{v.get('current_version')} ({v.get('policy')})"
                     f"{'' if v.get('versions_confirmed') else ' UNCONFIRMED'}  {reps}")
    lines.append("disagreements: " + ("none" if not report["disagreements"] else ""))
    lines += [f"  {d}" for d in report["disagreements"]]
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    """The ``status`` subcommand: print the report; exit 0 (agree), 1 (disagree), 2 (Redis unreachable)."""
    import logging
    import sys

    from router.state.redis_client import StateUnavailable

    logging.getLogger("router.state").setLevel(logging.ERROR)  # the report says it; no serving-path warnings

    try:
        report = asyncio.run(collect(args.redis_url, args.redis_prefix, args.alive_s, args.timeout_s))
    except StateUnavailable as exc:
        print(f"rollout-router status: redis {args.redis_url} unreachable: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if report["disagreements"] else 0
