"""One weight update's record: its request, phase and what it did to each target replica."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from cache_policy.types import ReplicaId
from router.errors import RouterError
from router.weights.requests import UpdateRequest
from router.weights.steps import ReplicaUpdate

LOCK_TTL_S = 60.0
"""The shared update lock's lifetime; refreshed every third of it while an update runs."""


class UpdateInProgress(RouterError):
    """Another weight update is running, or the call names an update that is not (409)."""

    status = 409


class VersionConflict(RouterError):
    """A folder update names a version the fleet already has, with another checkpoint folder or
    policy (409; ``param`` names the field): one version is one set of weights on every replica,
    and a repeat of a finished update must not change how later requests are salted."""

    status = 409


@dataclass
class Update:
    """One update: the request, its phase and what it did to each target replica."""

    req: UpdateRequest
    kind: str  # "folder" | "push"
    replicas: dict[ReplicaId, ReplicaUpdate]
    phase: str = "beginning"
    """beginning | ready (push: waiting for the trainer) | committing | aborting | done | aborted"""
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    seconds: float = 0.0
    task: asyncio.Task | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def report(self, state: dict[str, Any]) -> dict[str, Any]:
        r = self.req
        recs = list(self.replicas.values())
        if self.phase == "ready":
            ok = all(x.phase == "paused" for x in recs)
        elif self.phase == "aborted":
            ok = all(x.in_rotation and x.error is None for x in recs)
        else:
            ok = self.phase == "done" and all(x.ok for x in recs)
        return {"ok": ok, "kind": self.kind, "phase": self.phase, "version": r.version, "policy": r.policy,
                "mode": r.mode, "pause_mode": r.pause_mode, "transfer": r.transfer,
                "seconds": round(self.seconds or time.monotonic() - self.started, 3),
                "paused_s": round(sum(x.paused_s for x in recs), 3),
                "replicas": [x.as_json() for x in recs], "state": state}


