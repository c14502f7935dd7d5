"""When a pinned session or GRPO group moves: only when staying costs more than moving.

Issue 14: moving a pin by load alone (the old rule: foreign load > 3x the least other load + 4)
moved 20-30 sessions per GRPO run and prefilled 1.25-1.33x the ideal, while a sticky router
that never moves lets a session thrash on a saturated replica. The cost model, in prompt
tokens prefilled (the unit the router optimizes):

* A replica is **saturated** when its projected KV usage (``kv_cache_usage`` plus the blocks
  this request adds beyond its hit there, over ``num_gpu_blocks``) is over
  ``high_watermark`` **and** work queues there (``num_waiting > 0``). A replica of unknown
  capacity (``num_gpu_blocks == 0``) is never judged saturated.
* **Staying** on a saturated replica costs the wait behind its queue:
  ``num_waiting * move_queue_cost_tokens``.
* **Moving** to replica ``c`` costs the prefix it would prefill again,
  ``max(0, matched[pinned] - matched[c]) * block_size``, plus the wait behind ``c``'s own
  queue (same price per request). ``c`` must be healthy and not saturated itself.

The pin moves to the cheapest ``c`` (ties -> least loaded -> rng) when that costs strictly
less than staying. So a replica running a burst with room in its cache keeps its pins (not
saturated), another replica holding the prefix takes a pin as soon as the pinned one is
saturated (moving costs only its queue), and a replica without the prefix takes it once the
pinned queue has grown past the prefix's prefill. A session with a request in flight on its
replica never moves (a session's turns are sequential; the move waits for the next turn).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from cache_policy.config import PolicyConfig
from cache_policy.selection import load, pick_min
from cache_policy.types import ReplicaId, ReplicaView, RequestView


def saturated(view: ReplicaView, request: RequestView, matched_blocks: int, watermark: float) -> bool:
    """Projected KV usage with ``request`` over ``watermark`` and requests waiting there."""
    if view.num_gpu_blocks <= 0 or view.num_waiting <= 0:
        return False
    new_blocks = max(0, math.ceil(request.num_prompt_tokens / view.block_size) - matched_blocks)
    return view.kv_cache_usage + new_blocks / view.num_gpu_blocks > watermark


def stay_cost(view: ReplicaView, cfg: PolicyConfig) -> float:
    """Prompt-token price of waiting behind ``view``'s queue."""
    return view.num_waiting * cfg.move_queue_cost_tokens


def move_cost(target: ReplicaView, pinned_blocks: int, matched: Mapping[ReplicaId, int],
              cfg: PolicyConfig) -> float:
    """Prompt tokens prefilled again on ``target`` plus the price of its own queue."""
    lost = max(0, pinned_blocks - matched.get(target.replica_id, 0))
    return lost * target.block_size + stay_cost(target, cfg)


def move_target(pinned: ReplicaView, request: RequestView, candidates: Sequence[ReplicaView],
                matched: Mapping[ReplicaId, int], cfg: PolicyConfig,
                rng: random.Random) -> ReplicaView | None:
    """The replica a pin on healthy ``pinned`` should move to, or ``None`` to stay.

    ``candidates`` are the healthy replicas (``pinned`` among them or not); ``matched`` the
    prefix index's leading blocks per replica for ``request``.
    """
    held = matched.get(pinned.replica_id, 0)
    if not saturated(pinned, request, held, cfg.high_watermark):
        return None
    others = [c for c in candidates if c.replica_id != pinned.replica_id
              and not saturated(c, request, matched.get(c.replica_id, 0), cfg.high_watermark)]
    if not others:
        return None
    best = pick_min(others, lambda c: (move_cost(c, held, matched, cfg), load(c)), rng)
    return best if move_cost(best, held, matched, cfg) < stay_cost(pinned, cfg) else None
