"""vLLM KV cache events -> prefix index operations (pure; the ZMQ side is ``router.kv_events``).

vLLM 0.32 (``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``) publishes, per
engine step, an ``EventBatch`` of:

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, extra_keys, ...)``: the
  engine cached ``len(block_hashes)`` consecutive full blocks of ``token_ids``, chained after
  ``parent_block_hash`` (``None``: they start at block 0). ``extra_keys[i]`` are block ``i``'s
  untagged extra hash keys: for block 0 of a salted request ``(cache_salt,)`` (after the LoRA
  name, if any); multimodal pairs and prompt-embedding digests are other entries.
* ``BlockRemoved(block_hashes)``: the engine evicted those blocks.
* ``AllBlocksCleared``: the prefix cache was reset.

Engine hashes (a per-process hash of the engine's own) are not the router's hashes
(``cache_policy.hashing``), so :class:`KvEventApplier` rebuilds the router hash of each stored
block from its tokens, its parent's router hash (looked up in a bounded per-replica table,
engine hash -> router hash) and the salt, then confirms it in the :class:`PrefixIndex`.
A block it cannot rebuild (unknown parent, LoRA, multimodal keys, another block size, an
offload tier's medium, a KV group other than 0) is counted as ``unmapped`` and left out:
the index then under-predicts, never over-predicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cache_policy.hashing import chained_block_hashes
from cache_policy.prefix_index import PrefixIndex
from cache_policy.types import BlockHash, ReplicaId

EngineHash = int | bytes
"""vLLM's ``ExternalBlockHash``: a 64-bit int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""

DEVICE_MEDIA = (None, "GPU")
"""Media of the engine's own KV pool (the CPU engine reports ``"GPU"`` too); others are offload tiers."""


@dataclass(frozen=True)
class BlockStored:
    """vLLM's ``BlockStored``, the fields the router uses."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[tuple | None, ...] | None = None
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """vLLM's ``BlockRemoved``."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """vLLM's ``AllBlocksCleared``: the replica's prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventCounts:
    """Plain counters (blocks, except ``events`` and ``resets``), exported by the router."""

    events: int = 0
    stored: int = 0
    removed: int = 0
    unmapped: int = 0
    resets: int = 0


class _BoundedMap:
    """Engine hash -> router hash, least recently used first out past ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[EngineHash, BlockHash] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, key: EngineHash) -> BlockHash | None:
        value = self._map.get(key)
        if value is not None:
            self._map.move_to_end(key)
        return value

    def put(self, key: EngineHash, value: BlockHash) -> None:
        self._map[key] = value
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


@dataclass
class _Replica:
    blocks: _BoundedMap
    counts: EventCounts = field(default_factory=EventCounts)


class KvEventApplier:
    """Applies one replica's KV events to ``index`` (confirm / remove / forget).

    ``block_size`` and ``seed`` must be those the router hashes prompts with. Each replica's
    engine -> router table keeps at most ``max_mapped`` hashes (default: the index capacity);
    it survives ``BlockRemoved`` (a parent may be evicted before a child is stored again) and
    is dropped by :meth:`restarted` (a new engine process).
    """

    def __init__(self, index: PrefixIndex, block_size: int, *, seed: int = 0,
                 max_mapped: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
        self.index = index
        self.block_size = block_size
        self.seed = seed
        self.max_mapped = max_mapped or index.max_blocks
        self._replicas: dict[ReplicaId, _Replica] = {}

    def counts(self, replica: ReplicaId) -> EventCounts:
        """Counters of ``replica`` (zeros if it never sent an event)."""
        return self._state(replica).counts

    def mapped(self, replica: ReplicaId) -> int:
        """Engine hashes of ``replica`` the table can translate now."""
        return len(self._state(replica).blocks)

    def apply(self, replica: ReplicaId, events: Iterable[KvEvent], now: float) -> None:
        """Apply ``events`` of ``replica`` in order, at time ``now``; marks it event-fed."""
        state = self._state(replica)
        self.index.set_event_fed(replica, now=now)
        for event in events:
            state.counts.events += 1
            if isinstance(event, BlockStored):
                self._stored(replica, state, event, now)
            elif isinstance(event, BlockRemoved):
                self._removed(replica, state, event)
            elif isinstance(event, AllBlocksCleared):
                state.counts.resets += 1
                self.index.remove_replica(replica)
        self.index.expire(now)

    def forget(self, replica: ReplicaId) -> None:
        """Events of ``replica`` were lost beyond repair: drop its index entries (keep the table)."""
        self.index.remove_replica(replica)

    def restarted(self, replica: ReplicaId) -> None:
        """``replica`` runs a new engine: drop its index entries and its hash table."""
        self.index.remove_replica(replica)
        self._replicas.pop(replica, None)

    def _state(self, replica: ReplicaId) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = _Replica(_BoundedMap(self.max_mapped))
        return state

    def _stored(self, replica: ReplicaId, state: _Replica, event: BlockStored, now: float) -> None:
        hashes = router_hashes(event, state.blocks.get, self.block_size, self.seed)
        state.counts.unmapped += len(event.block_hashes) - len(hashes)
        if not hashes:
            return
        for engine_hash, router_hash in zip(event.block_hashes, hashes):
            state.blocks.put(engine_hash, router_hash)
        state.counts.stored += len(hashes)
        self.index.confirm(hashes, replica, now)

    def _removed(self, replica: ReplicaId, state: _Replica, event: BlockRemoved) -> None:
        if event.medium not in DEVICE_MEDIA or event.group_idx not in (None, 0):
            return
        found = [h for h in map(state.blocks.get, event.block_hashes) if h is not None]
        state.counts.unmapped += len(event.block_hashes) - len(found)
        state.counts.removed += len(found)
        self.index.remove(found, replica)


def router_hashes(event: BlockStored, parent_of, block_size: int, seed: int = 0) -> list[BlockHash]:
    """Router hashes of the leading blocks of ``event`` that can be rebuilt (maybe none).

    ``parent_of(engine_hash)`` returns the router hash of a block stored earlier, or ``None``.
    Stops at the first block whose extra keys the router does not hash (see module docstring).
    """
    n = len(event.block_hashes)
    if (event.block_size != block_size or len(event.token_ids) != n * block_size or event.lora_name
            or event.medium not in DEVICE_MEDIA or event.group_idx not in (None, 0)):
        return []
    keys = list(event.extra_keys or ()) + [None] * n
    if event.parent_block_hash is None:
        parent, ok, salt = None, *_salt_of(keys[0])
    else:
        parent, ok, salt = parent_of(event.parent_block_hash), True, None
        ok = parent is not None and keys[0] is None
    if not ok:
        return []
    usable = next((i for i in range(1, n) if keys[i] is not None), n)
    return chained_block_hashes(parent, event.token_ids[: usable * block_size], block_size, salt, seed=seed)


def _salt_of(keys: Sequence | None) -> tuple[bool, str | None]:
    """``(rebuildable, cache_salt)`` from block 0's untagged extra keys."""
    if not keys:
        return True, None
    if len(keys) == 1 and isinstance(keys[0], str) and keys[0]:
        return True, keys[0]
    return False, None
