"""``python -m bench.h2h`` (``bench.h2h.cli``)."""

from bench.h2h.cli import run

run()
