"""``python -m router`` is the ``rollout-router`` CLI."""

import sys

from router.cli import main

sys.exit(main())
