"""A paged KV block pool with prefix caching, in vLLM's eviction order.

Modelled on vLLM v1 ``BlockPool`` and ``FreeKVCacheBlockQueue``
(``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``, vLLM 0.32):

    free queue (front = evicted/reused first)                                  (back)
    [ uncached blocks, LIFO ... | cached blocks, least recently freed ... most recently freed ]

* A block is *in use* while ``ref[b] > 0`` and then is not in the free queue.
* ``free(blocks)`` takes a request's blocks in eviction priority (the caller passes them
  reversed: tail first, as ``SingleTypeKVCacheManager.free`` does). Blocks reaching ref 0
  with a hash go to the back in that order (FIFO = LRU); blocks without a hash go to the
  front (vLLM ``free_blocks``: "LIFO reuse of non-cached blocks").
* ``take(n)`` pops from the front and evicts the popped blocks' hashes
  (``get_new_blocks`` -> ``_maybe_evict_cached_block``).
* ``touch(blocks)`` takes a prefix hit: ref + 1, out of the free queue if it was there.
* Duplicate blocks for one hash may exist (two requests computing the same prefix in one
  step); the lookup returns the first, as ``BlockHashToBlockMap.get_one_block`` does.

The null block vLLM reserves is not modelled: ``num_blocks`` are all usable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockPool:
    """``num_blocks`` KV blocks, their reference counts, hashes and the free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, list[int]] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with ref 0 (free or evictable cached)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, as ``vllm:kv_cache_usage_perc`` reports it."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Distinct block hashes currently held."""
        return len(self.by_hash)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes[:max_blocks]`` (chain stops at a miss)."""
        out: list[int] = []
        by_hash = self.by_hash
        for h in hashes[:max_blocks]:
            blocks = by_hash.get(h)
            if blocks is None:
                break
            out.append(blocks[0])
        return out

    def evictable_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them consumes a free slot)."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on hit blocks, removing ref-0 ones from the free queue."""
        ref, fq = self.ref, self.free_queue
        for b in blocks:
            if ref[b] == 0:
                del fq[b]
            ref[b] += 1

    def take(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue, their hashes evicted; ValueError if short."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot take {n} blocks, {len(self.free_queue)} free")
        fq, ref, bh = self.free_queue, self.ref, self.block_hash
        out = []
        for _ in range(n):
            b, _ = fq.popitem(last=False)
            h = bh[b]
            if h is not None:
                self._unmap(h, b)
                bh[b] = None
                self.evictions += 1
            ref[b] = 1
            out.append(b)
        return out

    def _unmap(self, h: int, b: int) -> None:
        blocks = self.by_hash[h]
        blocks.remove(b)
        if not blocks:
            del self.by_hash[h]

    def cache(self, b: int, h: int) -> None:
        """Record that in-use block ``b`` now holds the full block with hash ``h``."""
        assert self.ref[b] > 0 and self.block_hash[b] is None, "bug: caching a free or hashed block"
        self.block_hash[b] = h
        blocks = self.by_hash.get(h)
        if blocks is None:
            self.by_hash[h] = [b]
        else:
            blocks.append(b)

    def free(self, ordered: Iterable[int]) -> None:
        """Drop one reference per block; ``ordered`` is eviction priority (first = evicted first)."""
        ref, bh, fq = self.ref, self.block_hash, self.free_queue
        uncached: list[int] = []
        for b in ordered:
            ref[b] -= 1
            assert ref[b] >= 0, "bug: block freed twice"
            if ref[b] == 0:
                if bh[b] is None:
                    uncached.append(b)
                else:
                    fq[b] = None
        for b in reversed(uncached):
            fq[b] = None
            fq.move_to_end(b, last=False)

    def reset(self) -> int:
        """Forget every hash (``reset_prefix_cache``); return how many blocks lost theirs."""
        n = sum(len(v) for v in self.by_hash.values())
        self.by_hash.clear()
        self.block_hash = [None] * self.num_blocks
        return n

    def check_integrity(self) -> None:
        """Assert the invariants in the class docstring; AssertionError on a bug."""
        assert all((self.ref[b] == 0) == (b in self.free_queue) for b in range(self.num_blocks))
        for h, blocks in self.by_hash.items():
            assert blocks and all(self.block_hash[b] == h for b in blocks)
        assert sum(len(v) for v in self.by_hash.values()) == sum(h is not None for h in self.block_hash)
