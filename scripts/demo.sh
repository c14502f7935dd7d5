#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default (configs/local.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m bench.demo_cli --config configs/local.yaml "$@"
