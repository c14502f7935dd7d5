"""Token-ID validation on the hot path: the router's bulk checks vs the per-token checks they replaced.

    .venv/bin/python -m bench.token_id_checks [--tokens 16000] [--repeat 50]

Prints milliseconds per prompt for both, side by side, and their ratio. The old checks, kept here
as the reference: ``PromptTokenizer.check_ids`` called ``len(tokenizer)`` for every token, and
``router.parse._is_token_ids`` did two ``isinstance`` calls per token.
"""

from __future__ import annotations

import argparse
import random
import time

from replicas.config import ReplicaSetConfig
from replicas.server import resolve_model
from router.parse import _is_token_ids
from router.tokenize import PromptTokenizer


def _old_is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _old_check_ids(tok: PromptTokenizer, ids: list[int]) -> None:
    next((t for t in ids if not 0 <= t < len(tok._tok)), None)


def _ms(fn, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.token_id_checks", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16000, help="prompt length in tokens (default: 16000)")
    parser.add_argument("--repeat", type=int, default=50, help="timed repetitions (default: 50)")
    args = parser.parse_args()
    tok = PromptTokenizer(resolve_model(ReplicaSetConfig()))
    ids = [random.Random(0).randrange(8, tok.vocab_size) for _ in range(args.tokens)]
    rows = [("type check (_is_token_ids)", _ms(lambda: _old_is_token_ids(ids), args.repeat),
             _ms(lambda: _is_token_ids(ids), args.repeat)),
            ("vocabulary check (check_ids)", _ms(lambda: _old_check_ids(tok, ids), max(1, args.repeat // 10)),
             _ms(lambda: tok.check_ids(ids, "prompt"), args.repeat))]
    print(f"{args.tokens} token IDs, ms per prompt:")
    for name, old, new in rows:
        print(f"  {name:30s} before {old:8.3f}  after {new:7.3f}  ({old / new:5.1f}x faster)")


if __name__ == "__main__":
    main()
