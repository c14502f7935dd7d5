"""Report whether the cap is active: the ``rollout_router_scoring_cap_active`` gauge on /metrics.

The decision lives in the engine core (it needs the engine's KV cache groups), the gauge in
the API server process (whose default Prometheus registry backs ``/metrics``;
``vllm/entrypoints/serve/instrumentator/metrics.py``). They meet through vLLM's utility-call
channel, which the API server already uses for ``get_supported_tasks``:

* engine core: adds the method ``EngineCore.rollout_router_scoring_cap_status`` (``vllm/v1/engine/core.py``),
  which returns ``[active, reason]``;
* API server: wraps ``init_app_state`` in ``vllm/entrypoints/launchers/api_server/entry.py``
  (run once, after the engine is up and before the server listens) to ask the engine core and
  set the gauge: ``rollout_router_scoring_cap_active{reason="ok"} 1`` or ``0`` with the
  fallback reason (also logged). An engine core that did not load the plugin answers with an
  error, reported as ``0`` with reason ``engine core: plugin not loaded``.

A refused ``register()`` (unknown vLLM) sets the gauge to ``0`` with the refusal reason and
patches nothing; with ``VLLM_PLUGINS=""`` the gauge is absent. With several API server
processes (``--api-server-count`` > 1, Prometheus multiprocess mode) the gauge is not exported.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from replicas.vllm_plugin.patching import add_method, wrap
from replicas.vllm_plugin.support import engine_support

logger = logging.getLogger("vllm.rollout_router.scoring_cap")

GAUGE_NAME = "rollout_router_scoring_cap_active"
STATUS_METHOD = "rollout_router_scoring_cap_status"
ENTRY_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_gauge: Any = None


def install_engine_status() -> None:
    from vllm.v1.engine.core import EngineCore

    add_method(EngineCore, STATUS_METHOD, rollout_router_scoring_cap_status)


def install_frontend_probe() -> None:
    import importlib

    wrap(importlib.import_module(ENTRY_MODULE), "init_app_state", _make_init_app_state)


def rollout_router_scoring_cap_status(self) -> list:
    """EngineCore utility method: ``[1 | 0, reason]`` for this engine."""
    support = engine_support(self)
    return [int(support.active), support.reason]


def set_gauge(active: bool, reason: str) -> None:
    """Export the cap state (one labelled series) in this process's default registry."""
    gauge = _get_gauge()
    gauge.clear()
    gauge.labels(reason=reason).set(1 if active else 0)


def _get_gauge() -> Any:
    global _gauge
    if _gauge is None:
        from prometheus_client import Gauge

        _gauge = Gauge(
            GAUGE_NAME,
            "1 if this replica bounds prefix-cache hits of scoring requests at S (the "
            "rollout-router vLLM plugin), 0 if it falls back to cache reads off; label: why.",
            labelnames=["reason"],
            multiprocess_mode="livemax",
        )
    return _gauge


def _make_init_app_state(original: Callable) -> Callable:
    async def init_app_state(engine_client, state, args, supported_tasks=None):
        result = await original(engine_client, state, args, supported_tasks)
        active, reason = await _ask_engine(engine_client)
        set_gauge(active, reason)
        log = logger.info if active else logger.warning
        log("rollout_router scoring cap %s on this replica (%s)", "active" if active else "inactive", reason)
        return result

    return init_app_state


async def _ask_engine(engine_client: Any) -> tuple[bool, str]:
    try:
        active, reason = await engine_client.engine_core.call_utility_async(STATUS_METHOD)
    except Exception as e:  # the engine core lacks the method, or no utility channel
        logger.warning("rollout_router scoring cap: engine core status unavailable: %s", e)
        return False, "engine core: plugin not loaded"
    return bool(active), str(reason)
