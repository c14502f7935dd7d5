"""``python -m bench.h2h.replicas_main``: serve N simulated replicas until SIGTERM/SIGINT.

Writes the replicas' base URLs (a JSON list) to ``--urls-file`` once every port listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

from bench.h2h.replica import FAST_COST, ZERO_COST, SimReplica
from bench.h2h.server import MODEL, serve
from bench.sim.engine import EngineConfig
from bench.sim.seqhash import SequenceHashes


def _tokenizer(path: str | None):
    if not path:
        return None, MODEL
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path), path


async def main(args: argparse.Namespace) -> None:
    cost = ZERO_COST if args.cost == "zero" else FAST_COST
    cfg = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=8192, cost=cost)
    hashes = SequenceHashes(args.block_size)
    replicas = [SimReplica(f"sim-{i}", cfg, hashes) for i in range(args.replicas)]
    tokenizer, root = await asyncio.to_thread(_tokenizer, args.tokenizer)
    urls = await serve(replicas, tokenizer, root)
    tmp = Path(args.urls_file + ".tmp")
    tmp.write_text(json.dumps(urls))
    os.replace(tmp, args.urls_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cost", choices=("fast", "zero"), default="fast")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer folder for text prompts (and /v1/models root)")
    p.add_argument("--urls-file", required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
