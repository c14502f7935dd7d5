"""Every typed application key of the router app, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from router.admin import WeightUpdater
    from router.admission import AdmissionController
    from router.config import AppConfig
    from router.dispatch import Dispatcher
    from router.metrics import RouterMetrics
    from router.pool import ReplicaPool
    from router.tokenize import PromptTokenizer
    from router.versions import WeightVersions

CONFIG = web.AppKey("config", "AppConfig")
POOL = web.AppKey("pool", "ReplicaPool")
METRICS = web.AppKey("metrics", "RouterMetrics")
HTTP = web.AppKey("http", aiohttp.ClientSession)
TOKENIZER = web.AppKey("tokenizer", "PromptTokenizer")
DISPATCHER = web.AppKey("dispatcher", "Dispatcher")
ADMISSION = web.AppKey("admission", "AdmissionController")
VERSIONS = web.AppKey("versions", "WeightVersions")
WEIGHT_UPDATER = web.AppKey("weight_updater", "WeightUpdater")
