"""``python -m bench.demo_cli`` (``bash scripts/demo.sh``): the main job, GRPO and agent traffic
through the router vs round-robin on real replicas. Flags come from the config and workload
dataclasses (every default written once); ``--config`` names a YAML file."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from bench.workloads import AgentWorkload, GrpoWorkload
from router.cli import add_dataclass_flags, dataclass_overrides
from router.config import AppConfig, RouterConfig


def parser() -> argparse.ArgumentParser:
    """The demo's flags: config, replicas, router fields (no host/port/policy: it runs one router
    per policy on free ports), and the two workloads' sizes."""
    p = argparse.ArgumentParser(prog="scripts/demo.sh", description="Run GRPO and agent traffic through the "
                                "router vs round-robin on real vLLM replicas; print and plot prefilled tokens.")
    p.add_argument("--config", default=None, help="YAML config (sections router, replicas, policy)")
    p.add_argument("--num-replicas", type=int, default=None, help="override replicas.num_replicas")
    p.add_argument("--log-level", default="WARNING", help="DEBUG | INFO | WARNING | ERROR (default: WARNING)")
    p.add_argument("--out", default="results/demo.json", help="JSON results (a PNG plot goes beside it)")
    add_dataclass_flags(p, GrpoWorkload, "grpo-")  # the demo's own sizes first, then the router's settings
    add_dataclass_flags(p, AgentWorkload, "agent-")
    add_dataclass_flags(p, RouterConfig, skip=frozenset({"host", "port", "policy"}))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = AppConfig.load(args.config)
        replicas = {"num_replicas": args.num_replicas} if args.num_replicas else {}
        cfg = cfg.replace(router=dataclass_overrides(args, RouterConfig), replicas=replicas)
        grpo = GrpoWorkload(**dataclass_overrides(args, GrpoWorkload, "grpo-"))
        agent = AgentWorkload(**dataclass_overrides(args, AgentWorkload, "agent-"))
    except ValueError as exc:
        print(f"bench.demo_cli: config error: {exc}", file=sys.stderr)
        return 2
    from bench.demo import run_demo

    try:
        asyncio.run(run_demo(cfg, grpo, agent, Path(args.out)))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
