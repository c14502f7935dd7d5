"""Router configuration and the YAML file that combines router, replica and policy sections.

Every default is written once, here (router), in `replicas.config` (replicas) and in
`cache_policy.config` (policy thresholds). YAML files hold overrides only and are checked
against these dataclasses: an unknown key is a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cache_policy.config import PolicyConfig
from cache_policy.policy import POLICIES
from replicas.config import ReplicaSetConfig


@dataclass(frozen=True)
class RouterConfig:
    """How the router listens, routes and talks to replicas."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0 picks a free one)."""
    policy: str = "prefix_affinity"
    """Routing policy: prefix_affinity | round_robin | least_load."""
    seed: int = 0
    """Seed of the policy's tie-breaking random generator."""
    request_timeout_s: float = 600.0
    """Total time allowed for one upstream request, in seconds."""
    connect_retries: int = 1
    """Extra attempts on another replica when a replica cannot be reached (nothing was sent)."""
    scrape_interval_s: float = 1.0
    """Seconds between /metrics scrapes of each replica; 0 disables the scrape loop."""
    admin_token: str | None = None
    """Bearer token required by /admin/* endpoints; None disables them."""
    state: Literal["memory", "redis"] = "memory"
    """Where session/group pins and the replica registry live: this process, or Redis shared by routers."""
    redis_url: str | None = None
    """Redis URL when state is 'redis'."""
    tokenizer: str | None = None
    """Tokenizer path for text prompts; default: the replicas' model."""
    admission: bool = True
    """Admission control (DESIGN rule 3): hold requests while their replica's projected KV usage
    would pass ``policy.high_watermark``; 429 past ``policy.max_queue`` / ``queue_timeout_s``."""
    admission_default_max_tokens: int = 256
    """Output tokens admission reserves for a request that gives no ``max_tokens``."""
    weight_update_policy: Literal["flush", "keep", "salt", "keep+salt"] = "keep+salt"
    """Cache policy at weight updates (seed 003): flush | keep | salt | keep+salt; an update may
    name its own, which then stays in force."""
    weight_update_mode: Literal["rolling", "all"] = "rolling"
    """POST /admin/weights updates replicas one at a time (the rest keep serving) or all at once."""
    weight_update_pause_mode: Literal["keep", "wait", "abort"] = "wait"
    """How a replica pauses for an update: wait for in-flight requests, keep them frozen (they
    finish under the new weights, and say so), or abort them."""
    flush_preempt_running: bool = True
    """Under 'flush', let the prefix-cache reset preempt requests kept across the update (they
    re-prefill under the new weights); False: such a reset is refused and the replica fails."""
    initial_weight_version: int | None = 0
    """Weight version the replicas serve at start; None: unknown (no salt until an update)."""
    initial_weights_path: str | None = None
    """Checkpoint folder the replicas serve at start, reloaded if an update's load fails;
    default: the replicas' model when it is a local folder."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router.policy {self.policy!r} is unknown; valid: {', '.join(sorted(POLICIES))}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"router.port must be in [0, 65535], got {self.port}")
        if self.scrape_interval_s < 0:
            raise ValueError("router.scrape_interval_s must be >= 0 (0 disables scraping)")
        if self.connect_retries < 0:
            raise ValueError("router.connect_retries must be >= 0")
        if self.state == "redis" and not self.redis_url:
            raise ValueError("router.state is 'redis' but router.redis_url is not set")
        if self.state not in ("memory", "redis"):
            raise ValueError(f"router.state must be 'memory' or 'redis', got {self.state!r}")
        if self.admission_default_max_tokens < 1:
            raise ValueError("router.admission_default_max_tokens must be >= 1")
        _one_of(self, "weight_update_policy", ("flush", "keep", "salt", "keep+salt"))
        _one_of(self, "weight_update_mode", ("rolling", "all"))
        _one_of(self, "weight_update_pause_mode", ("keep", "wait", "abort"))
        if self.initial_weight_version is not None and self.initial_weight_version < 0:
            raise ValueError("router.initial_weight_version must be >= 0 or None")


def _one_of(cfg: RouterConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"router.{name} must be one of {', '.join(choices)}; got {value!r}")


def from_mapping(cls: type, data: dict[str, Any] | None, section: str):
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys (ValueError names them)."""
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown key(s) in '{section}': {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    for f in dataclasses.fields(cls):
        if f.name in data and isinstance(data[f.name], list):
            data[f.name] = tuple(data[f.name])
    return cls(**data)


@dataclass(frozen=True)
class AppConfig:
    """The whole deployment: the three sections of a YAML config file."""

    router: RouterConfig = field(default_factory=RouterConfig)
    replicas: ReplicaSetConfig = field(default_factory=ReplicaSetConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @classmethod
    def load(cls, path: str | Path | None) -> "AppConfig":
        """Read a YAML file (None -> all defaults). Raises ValueError on unknown sections or keys."""
        raw = yaml.safe_load(Path(path).read_text()) if path else {}
        raw = raw or {}
        unknown = sorted(set(raw) - {"router", "replicas", "policy"})
        if unknown:
            raise ValueError(f"unknown section(s) in {path}: {', '.join(unknown)}; valid: router, replicas, policy")
        return cls(
            router=from_mapping(RouterConfig, raw.get("router"), "router"),
            replicas=from_mapping(ReplicaSetConfig, raw.get("replicas"), "replicas"),
            policy=from_mapping(PolicyConfig, raw.get("policy"), "policy"),
        )

    def replace(self, **sections: Any) -> "AppConfig":
        """Return a copy with some section fields overridden: ``replace(router={"port": 0})``."""
        return AppConfig(
            **{
                name: dataclasses.replace(getattr(self, name), **sections.get(name, {}))
                for name in ("router", "replicas", "policy")
            }
        )
