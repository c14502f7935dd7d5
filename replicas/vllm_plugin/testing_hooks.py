"""Test-only switches, off unless the replica runs with ``ROLLOUT_ROUTER_PLUGIN_TEST_HOOKS=1``.

The only hook lets a test show that an incomplete score buffer is rejected: a request with
``vllm_xargs`` ``{"rollout_router_test_skip_cap": true}`` (next to S) gets cache reads turned on
*without* the cap, so a cached prefix reaching past S leaves rows from S on uncomputed. The
flag is ignored on replicas started without the environment variable; never set it in
production. This is the one module that reads the plugin's environment variables.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

TEST_HOOKS_ENV = "ROLLOUT_ROUTER_PLUGIN_TEST_HOOKS"
SKIP_CAP_KEY = "rollout_router_test_skip_cap"


def hooks_enabled() -> bool:
    """Whether this process honours test-only request flags."""
    return os.environ.get(TEST_HOOKS_ENV, "") == "1"


def skip_cap_requested(extra_args: Mapping[str, Any] | None) -> bool:
    """True when test hooks are on and the request asks to bypass the cap."""
    return bool(extra_args) and extra_args.get(SKIP_CAP_KEY) in (True, 1, "true") and hooks_enabled()
