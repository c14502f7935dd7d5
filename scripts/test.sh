#!/usr/bin/env bash
# Install everything the tests need (venv, packages, tiny models, redis-server) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""  # apt-get needs root: sudo when not root and it is there
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo"; fi
  $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
echo "test run took $(( $(date +%s) - start )) s"
exit $rc
