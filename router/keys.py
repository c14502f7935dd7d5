"""Every typed application key of the router app, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from cache_policy.core import DecisionCore
    from router.admin import WeightUpdater
    from router.config import AppConfig
    from router.lifecycle import Lifecycle
    from router.metrics import RouterMetrics
    from router.pool import ReplicaPool
    from router.tokenize import PromptTokenizer

CONFIG = web.AppKey("config", "AppConfig")
POOL = web.AppKey("pool", "ReplicaPool")
CORE = web.AppKey("core", "DecisionCore")
METRICS = web.AppKey("metrics", "RouterMetrics")
HTTP = web.AppKey("http", aiohttp.ClientSession)
TOKENIZER = web.AppKey("tokenizer", "PromptTokenizer")
LIFECYCLE = web.AppKey("lifecycle", "Lifecycle")
WEIGHT_UPDATER = web.AppKey("weight_updater", "WeightUpdater")
