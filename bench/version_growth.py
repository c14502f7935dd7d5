"""``python -m bench.version_growth``: what a week of weight updates costs per answer and per update.

Under ``keep`` a replica's prefix cache may hold KV of every version since its last reset, so each
answer's ``kv_versions`` lists them all (``DecisionCore.kv_versions``: ascending, each once), and
every router's version snapshot (``cache_policy.sharing``) carries the whole ``history``. After
``--versions`` updates (default 20,000: a week at one every 30 s) this times, side by side in one
run, on a book built with that many versions and ``--replicas`` replicas:

* the answer's first span (``router.weights.report.span``) over the core's list, taken as it is
  (``ordered=True``, what the router does) against sorted again (``ordered=False``);
* applying another router's snapshot that adds one version (``apply_versions``), against the set
  merge every apply ran before (``sorted(set(mine) | set(theirs))``);
* the snapshot's JSON, encoded and decoded (its size is printed).

Prints microseconds per call (median of ``--repeat``) and the ratio of each baseline to ours.
Pure Python, no engines: seconds on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from cache_policy.sharing import VersionSnapshot, apply_versions, versions_snapshot
from cache_policy.types import ReplicaId
from cache_policy.versions import NO_SALT, VersionBook
from router.weights.report import span


def book_with(versions: int, replicas: int) -> VersionBook:
    """A ``keep`` book whose ``replicas`` replicas each loaded versions 0 .. ``versions - 1``."""
    book = VersionBook("keep", 0)
    rids = [ReplicaId(f"replica-{i}") for i in range(replicas)]
    for rid in rids:
        book.set_loaded(rid, 0)
    for v in range(1, versions):
        book.finish_update(v, "keep")
        for rid in rids:
            book.set_loaded(rid, v)
    return book


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median microseconds of ``fn()`` over ``repeat`` calls."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def run(versions: int, replicas: int, repeat: int) -> list[tuple[str, float, float | None]]:
    """``(what, ours us, baseline us or None)`` rows."""
    book = book_with(versions, replicas)
    rid = ReplicaId("replica-0")
    kv = book.kv_versions(rid, NO_SALT)  # an unsalted request under keep: every version since the reset
    newest = book.current
    rows: list[tuple[str, float, float | None]] = [
        (f"answer's first span over {len(kv):,} versions",
         timed(lambda: span(newest, kv, {}, ordered=True), repeat), timed(lambda: span(newest, kv, {}), repeat)),
    ]
    follower = book_with(versions, replicas)
    book.finish_update(versions, "keep")  # the update the snapshot carries
    snapshot = versions_snapshot(book)
    known = list(follower.loaded)
    mine = list(follower.history)

    def merge_as_sets() -> None:
        follower.history[:] = sorted(set(mine) | set(snapshot.history))

    def apply() -> None:
        follower.history[:] = mine  # as before the snapshot, each time
        apply_versions(follower, snapshot, known)

    rows.append(("apply another router's snapshot (history merge)", timed(apply, repeat), timed(merge_as_sets, repeat)))
    raw = json.dumps(snapshot.as_json())
    rows.append((f"snapshot JSON encode ({len(raw) / 1024:,.0f} KiB)", timed(lambda: json.dumps(snapshot.as_json()), repeat), None))
    rows.append(("snapshot JSON decode", timed(lambda: VersionSnapshot.from_json(json.loads(raw)), repeat), None))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.version_growth", description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=20_000, help="updates so far (default: a week at one every 30 s)")
    p.add_argument("--replicas", type=int, default=8, help="replicas in the book, each with every version (default 8)")
    p.add_argument("--repeat", type=int, default=50, help="calls timed per row (the median is printed)")
    args = p.parse_args(argv)
    rows = run(args.versions, args.replicas, args.repeat)
    table = Table(title=f"{args.versions:,} weight versions, {args.replicas} replicas (median of {args.repeat}; "
                        "microseconds; before: the same step done the old way, run here too)")
    for col in ("what", "ours µs", "before µs", "before / ours"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for what, ours, before in rows:
        table.add_row(what, f"{ours:,.1f}", "" if before is None else f"{before:,.1f}",
                      "" if before is None else f"{before / ours:,.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
