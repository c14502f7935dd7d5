"""Router configuration and the YAML file that combines router, replica and policy sections.

Every default is written once, here (router), in `replicas.config` (replicas) and in
`cache_policy.config` (policy thresholds). Each section is a frozen pydantic dataclass: YAML files
hold overrides only and are checked against them before anything starts, and any mistake (an
unknown key, a wrong type, a value vLLM would refuse) is one ``ValueError`` line naming its YAML
path, e.g. ``replicas.kv_cache_space_gib: must be a whole number of GiB, got 1.5``.
Each choice list is defined once by its owner and imported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import model_validator
from pydantic.dataclasses import dataclass

from cache_policy.config import PolicyConfig
from cache_policy.config_errors import SECTION_CONFIG, one_line, validate_one_line
from cache_policy.policy import POLICIES
from cache_policy.salts import WeightUpdatePolicy
from replicas.config import ReplicaSetConfig
from replicas.weights import PauseMode

RoutingPolicy = Literal[tuple(POLICIES)]  # type: ignore[valid-type]
"""Routing policy names, as registered in ``cache_policy.policy.POLICIES``."""
StateKind = Literal["memory", "redis"]
"""Where shared routing state lives (``router.shared_state.make_state``)."""
STATE_KINDS: tuple[str, ...] = get_args(StateKind)
UpdateMode = Literal["rolling", "all"]
"""How ``POST /admin/weights`` walks the replicas (``router.admin``)."""
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
EventLoop = Literal["uvloop", "asyncio"]
"""The event loop ``rollout-router serve`` runs on (``router.cli``)."""
SECTIONS = {"router": "router", "replicas": "ReplicaSetConfig", "policy": "PolicyConfig"}
"""YAML section -> the owner name its config errors start with."""


@dataclass(frozen=True, config=SECTION_CONFIG)
class RouterConfig:
    """How the router listens, routes and talks to replicas."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0 picks a free one)."""
    policy: RoutingPolicy = "prefix_affinity"
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
    state: StateKind = "memory"
    """Where pins, weight versions, the replica registry, in-flight shares and the update lock live:
    this process, or a Redis shared by every router of the fleet (README "Several routers")."""
    redis_url: str | None = None
    """Redis URL when state is 'redis' (every router of one fleet names the same one)."""
    redis_timeout_s: float = 0.075
    """Deadline of every Redis call, in seconds: a Redis that is down or hung costs a request at
    most this (then the router decides from its own state)."""
    redis_breaker_failures: int = 3
    """Consecutive failed Redis calls that open the circuit breaker (calls then fail at once)."""
    redis_breaker_reset_s: float = 1.0
    """Seconds the breaker stays open before one call probes Redis again."""
    redis_pin_ttl_s: int = 3600
    """Seconds a shared session/group pin lives in Redis after its last use."""
    redis_prefix: str = "rollout-router:"
    """Prefix of every Redis key (routers of one fleet share it; another fleet picks another)."""
    state_sync_interval_s: float = 0.25
    """Seconds between shared-state sync rounds (heartbeat, in-flight shares, versions, registry);
    0 disables the loop (pins and versions are still read and written with each request)."""
    tokenizer: str | None = None
    """Tokenizer path for text prompts; default: the replicas' model (with ``replicas.urls``: the
    served model's folder when ``/v1/models`` names one on this machine, else none: token-ID
    prompts only, text gets a 400)."""
    kv_events: bool = True
    """Follow the replicas' KV cache events (those that publish them, ``ReplicaEndpoint.kv_events``):
    the prefix index learns what each engine really holds; False: predictions only."""
    admission: bool = True
    """Admission control (DESIGN rule 3): hold requests while their replica's projected KV usage
    would pass ``policy.high_watermark``; 429 past ``policy.max_queue`` / ``queue_timeout_s``."""
    admission_default_max_tokens: int = 256
    """Output tokens admission reserves for a request that gives no ``max_tokens``."""
    weight_update_policy: WeightUpdatePolicy = "keep+salt"
    """Cache policy at weight updates (seed 003): flush | keep | salt | keep+salt; an update may
    name its own, which then stays in force."""
    weight_update_mode: UpdateMode = "rolling"
    """POST /admin/weights updates replicas one at a time (the rest keep serving) or all at once."""
    weight_update_pause_mode: PauseMode = "wait"
    """How a replica pauses for an update: wait for in-flight requests, keep them frozen (they
    finish under the new weights, and say so), or abort them."""
    flush_preempt_running: bool = True
    """Under 'flush', let the prefix-cache reset preempt requests kept across the update (they
    re-prefill under the new weights); False: such a reset is refused and the replica fails."""
    weight_update_drain_s: float = 600.0
    """How long an update under ``pause_mode: wait`` waits for a replica's in-flight work to
    finish (after it the replica is not updated). ``keep`` and ``abort`` drain 0 s by default
    (what is left is kept or ended: the README's Version contract). An update may name its own
    ``drain_timeout_s`` under any mode."""
    weight_update_commit_timeout_s: float = 600.0
    """A two-phase update (``POST /admin/weights/begin``) not committed or aborted within this
    many seconds is aborted by the router: no replica waits forever for a trainer that left."""
    max_staleness: int | None = None
    """A request tagged with a ``weight_version`` more than this many versions behind the current
    one is answered 409 naming both (the asynchronous-RL off-policyness bound); None: off."""
    initial_weight_version: int | None = 0
    """Weight version the replicas serve at start; None: unknown (no salt until an update)."""
    initial_weights_path: str | None = None
    """Checkpoint folder the replicas serve at start, reloaded if an update's load fails;
    default: the replicas' model when it is a local folder."""

    max_model_len: int | None = None
    """Longest prompt + output the router lets through (prompts and ``max_tokens`` are checked
    against it before admission); None: ``replicas.max_model_len`` (with ``replicas.urls``: the
    smallest the servers' ``/v1/models`` reports)."""
    max_prompt_chars: int | None = None
    """Longest text prompt or chat conversation, in characters, refused before tokenizing (a cheap
    bound that keeps huge texts off the tokenizer); None: 16 x the max model length."""
    max_n: int = 64
    """Largest ``n`` (samples per prompt) a request may ask for."""
    max_score_responses: int = 64
    """Largest number of responses (K) one ``/v1/score`` request may carry."""
    max_key_chars: int = 256
    """Longest session id, group id or tenant, in characters."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body, in bytes (413 past it, before it is read)."""
    max_header_bytes: int = 8190
    """Longest request line and longest single header, in bytes (aiohttp's limit; 400 past it)."""
    event_loop: EventLoop = "uvloop"
    """Event loop of ``rollout-router serve``: uvloop (libuv; less time per request in the loop
    and its sockets) or asyncio (the standard library's)."""
    busy_poll_ms: float = 0.0
    """After each API request ends (one whose API key the router accepted), the event loop polls
    without sleeping for this many milliseconds (module ``router/busy_poll.py``): a request that
    follows within it finds the router awake instead of waking a halted CPU (about 0.2-0.3 ms
    less added latency on new prompts on this project's VMs, side by side; README, Busy polling),
    for up to one CPU core while requests keep coming, which other work on the machine then lacks
    (CPU-bound neighbours took 1.8x as long: ``bench.h2h.neighbours``); 0: off (the loop sleeps
    whenever it waits)."""
    fast_lane: bool = True
    """Serve plain non-streamed ``POST /v1/completions`` requests on a bare asyncio protocol
    (``router.fastlane``: about 0.37 ms less per request than aiohttp's server), the same
    middlewares and handler; false: aiohttp serves every request."""
    header_timeout_s: float = 30.0
    """Seconds a connection may stay idle or take to send a request's headers before it is closed.
    Longer than the clients' own keep-alive pools (aiohttp's 15 s, httpx's and so the ``openai``
    SDK's 5 s): a server that closes an idle connection as the client reuses it fails that request
    with a disconnect the client does not retry (aiohttp issue #2682, a sub-millisecond window at
    the timeout; at the old 15 s, one of this suite's aiohttp requests met it in CI)."""
    body_timeout_s: float = 30.0
    """Seconds a client may take to send a request body (408 past it)."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM/SIGINT, seconds in-flight requests get to finish before they are cut (queued
    ones and new ones get 503 with Retry-After at once)."""
    api_keys: dict[str, str | None] = field(default_factory=dict)
    """API keys the OpenAI endpoints (``/v1/*``) accept as ``Authorization: Bearer <key>``, each
    mapped to the tenant it acts for (null: none); empty: no key needed. Separate from
    ``admin_token``."""
    tenant_header: bool = False
    """Take the tenant from the ``X-Tenant-Id`` header (a key's own tenant wins and must agree);
    False: the header is refused (400), so it never silently does nothing."""
    expose_expected_cached_tokens: bool = True
    """Send ``X-Rollout-Expected-Cached-Tokens`` and the ``expected_cached_tokens`` annotation;
    False hides what the router predicts is cached from clients."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_line(cls, data: Any, handler: Any) -> Any:
        return validate_one_line("router", data, handler)

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        _check(0 <= self.busy_poll_ms <= 60_000, "busy_poll_ms",
               f"must be in [0, 60000] milliseconds (0: off), got {self.busy_poll_ms}")
        _check(self.scrape_interval_s >= 0, "scrape_interval_s", "must be >= 0 (0 disables scraping)")
        _check(self.connect_retries >= 0, "connect_retries", "must be >= 0")
        _check(self.state != "redis" or bool(self.redis_url), "redis_url",
               "must be set when router.state is 'redis'")
        _check(0 < self.redis_timeout_s <= 5, "redis_timeout_s", "must be in (0, 5] seconds")
        _check(self.redis_breaker_failures >= 1, "redis_breaker_failures", "must be >= 1")
        _check(self.redis_breaker_reset_s > 0, "redis_breaker_reset_s", "must be > 0")
        _check(self.redis_pin_ttl_s >= 1, "redis_pin_ttl_s", "must be >= 1")
        _check(self.state_sync_interval_s >= 0, "state_sync_interval_s", "must be >= 0 (0 disables the sync loop)")
        _check(self.admission_default_max_tokens >= 1, "admission_default_max_tokens", "must be >= 1")
        _check(self.initial_weight_version is None or self.initial_weight_version >= 0,
               "initial_weight_version", "must be >= 0 or None")
        _check(self.max_staleness is None or self.max_staleness >= 0, "max_staleness", "must be >= 0 or null")
        _check(self.weight_update_drain_s >= 0, "weight_update_drain_s", "must be >= 0 seconds")
        _check(self.weight_update_commit_timeout_s > 0, "weight_update_commit_timeout_s", "must be > 0 seconds")
        for name in ("max_n", "max_score_responses", "max_key_chars", "max_body_bytes", "max_header_bytes"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_prompt_chars"):
            value = getattr(self, name)
            _check(value is None or value >= 1, name, f"must be >= 1 or null, got {value}")
        _check(self.shutdown_grace_s >= 0, "shutdown_grace_s", f"must be >= 0 seconds, got {self.shutdown_grace_s}")
        for name in ("header_timeout_s", "body_timeout_s", "request_timeout_s"):
            _check(getattr(self, name) > 0, name, f"must be > 0 seconds, got {getattr(self, name)}")
        _check(all(key for key in self.api_keys), "api_keys", "must not hold an empty key")


def _check(ok: bool, name: str, reason: str) -> None:
    if not ok:
        raise ValueError(f"router.{name}: {reason}")


def from_mapping(cls: type, data: dict[str, Any] | None, section: str):
    """Build config dataclass ``cls`` from ``data`` (one YAML section).

    Raises ValueError with one line: unknown keys named with the valid ones, or the first
    invalid field as ``<section>.<field>: <reason>``.
    """
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{section}: must be a mapping of settings, got {data!r}")
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown key(s) in '{section}': {', '.join(map(str, unknown))}; "
                         f"valid: {', '.join(sorted(names))}")
    for f in dataclasses.fields(cls):
        if f.name in data and isinstance(data[f.name], list):
            data[f.name] = tuple(data[f.name])
    return _built(section, lambda: cls(**data))


def _built(section: str, build):
    """``build()``, its config error re-raised as one line starting with the YAML ``section``."""
    try:
        return build()
    except ValueError as exc:
        message = one_line(exc)
        owner = SECTIONS[section]
        if message.startswith(owner + "."):
            message = section + message[len(owner):]
        raise ValueError(message) from None


@dataclass(frozen=True, config=SECTION_CONFIG)
class AppConfig:
    """The whole deployment: the three sections of a YAML config file."""

    router: RouterConfig = field(default_factory=RouterConfig)
    replicas: ReplicaSetConfig = field(default_factory=ReplicaSetConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output: ``router.max_model_len``, else the replicas'."""
        return self.model_len_for()

    @property
    def max_prompt_chars(self) -> int:
        """Character bound on a text prompt before tokenizing (``router.max_prompt_chars``)."""
        return self.prompt_chars_for()

    def model_len_for(self, reported: Iterable[int] = ()) -> int:
        """Longest prompt + output in front of servers that ``reported`` these ``max_model_len``s
        (``/v1/models``): ``router.max_model_len`` when set, else the smallest reported, else
        ``replicas.max_model_len``."""
        return self.router.max_model_len or min(reported, default=self.replicas.max_model_len)

    def prompt_chars_for(self, reported: Iterable[int] = ()) -> int:
        """``router.max_prompt_chars``, else 16 characters per token of :meth:`model_len_for`."""
        return self.router.max_prompt_chars or 16 * self.model_len_for(reported)

    @classmethod
    def load(cls, path: str | Path | None) -> "AppConfig":
        """Read a YAML file (None -> all defaults). Raises ValueError (one line naming the YAML
        path) on an unknown section or key, a wrong type or a refused value."""
        try:
            raw = yaml.safe_load(Path(path).read_text()) if path else {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a mapping with sections router, replicas, policy")
        unknown = sorted(set(raw) - set(SECTIONS))
        if unknown:
            raise ValueError(f"unknown section(s) in {path}: {', '.join(map(str, unknown))}; "
                             "valid: router, replicas, policy")
        return cls(
            router=from_mapping(RouterConfig, raw.get("router"), "router"),
            replicas=_built("replicas", lambda: ReplicaSetConfig.from_dict(raw.get("replicas"))),
            policy=from_mapping(PolicyConfig, raw.get("policy"), "policy"),
        )

    def replace(self, **sections: Any) -> "AppConfig":
        """Return a copy with some section fields overridden: ``replace(router={"port": 0})``.
        Raises ValueError (one line naming ``<section>.<field>``) on a bad value."""
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            raise ValueError(f"unknown section(s): {', '.join(unknown)}; valid: router, replicas, policy")
        return AppConfig(**{
            name: _built(name, lambda name=name: dataclasses.replace(getattr(self, name), **sections.get(name, {})))
            for name in SECTIONS
        })
