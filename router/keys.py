"""Every typed application key of the router app, in one place.

A leaf module: it imports nothing from ``router/`` or ``cache_policy/`` (every module that
reads the app imports it, so any import here would close a cycle). Each key's type is named
as a string: ``CORE`` holds a ``cache_policy.core.DecisionCore``, ``WEIGHT_UPDATER`` a
``router.weights.updater.WeightUpdater``, and so on.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

CONFIG = web.AppKey("config", "router.config.AppConfig")
LIMITS = web.AppKey("limits", "router.parse.Limits")
"""``router.parse.Limits.of(app[CONFIG], endpoints)``, computed once at start (the config is frozen;
a replica added later with a shorter ``max_model_len`` refuses a longer prompt with its own 400)."""
POOL = web.AppKey("pool", "router.pool.ReplicaPool")
CORE = web.AppKey("core", "cache_policy.core.DecisionCore")
METRICS = web.AppKey("metrics", "router.metrics.RouterMetrics")
HTTP = web.AppKey("http", aiohttp.ClientSession)
TOKENIZER = web.AppKey("tokenizer", "router.tokenize.PromptTokenizer")
LIFECYCLE = web.AppKey("lifecycle", "router.lifecycle.Lifecycle")
WEIGHT_UPDATER = web.AppKey("weight_updater", "router.weights.updater.WeightUpdater")
OWN_ADDRESSES = web.AppKey("own_addresses", set)
"""``(host, port)`` pairs the router listens on (``replicas.addresses.host_key`` spellings too),
filled by ``router.server.running_router`` once bound: a replica URL leading there is the router
itself (``router.fleet``)."""
FAST_HANDLER = web.AppKey("fast_handler", object)
"""The handler of ``router.fastlane.FAST_PATH`` (``router.handlers.completions``), which the fast
lane runs inside the app's middlewares; set by ``create_app`` beside the route."""
PROBES = web.AppKey("probes", "router.scrape.EngineProbes")
"""The scrape loop's probes of idle engines (``router.fleet.on_replica_event`` cancels a replica's
at its restart); absent with ``router.scrape_interval_s`` 0."""
