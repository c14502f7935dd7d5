"""CLI: ``python -m replicas.tiny_model [--seed N] [--out DIR]`` prints the model folder."""

import argparse

from replicas.tiny_model.generate import TinyModelSpec, ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description="Generate the tiny random-weight Llama (idempotent).")
    parser.add_argument("--seed", type=int, default=TinyModelSpec.seed, help="weight seed (default %(default)s)")
    parser.add_argument("--out", default=None, help="output folder (default: the cache folder)")
    args = parser.parse_args()
    print(ensure_tiny_model(args.out, TinyModelSpec(seed=args.seed)))


if __name__ == "__main__":
    main()
