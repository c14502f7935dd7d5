"""SGLang's cache-aware policy (``sgl-router/src/policies/cache_aware.rs``), as a baseline.

Behaviour, from that file's header and ``select_worker``, with the defaults a user gets from the
command line (``launch_router``: ``--cache-threshold 0.3 --balance-abs-threshold 64
--balance-rel-threshold 1.5``, ``max_tree_size`` 2**26):

* load = requests in flight at the router; imbalanced iff ``max - min > abs`` and
  ``max > rel * min``: then the least loaded replica, and the prompt is inserted for it;
* otherwise the longest prefix match in the approximate tree; if ``matched / prompt >
  cache_threshold`` the matching replica, else the replica with the smallest tree; the prompt
  is inserted for the chosen replica.

The tree here is keyed by the prompt's chained block hashes (one node per full block) instead
of characters: a chain of hashes *is* a radix-tree path. Each node keeps its replicas, most
recently inserted last; a match takes the deepest node's most recent replica. The tree is
bounded at ``max_nodes`` blocks, oldest inserted first out (SGLang evicts LRU leaves
periodically; at the CLI default size it rarely does).
"""

from __future__ import annotations

from bench.sim.baselines import Baseline
from bench.sim.router import Handle


class CacheAware(Baseline):
    name = "cache_aware"

    def __init__(self, weight_policy: str = "keep+salt", *, cache_threshold: float = 0.3,
                 balance_abs: int = 64, balance_rel: float = 1.5, max_nodes: int = 4_000_000) -> None:
        super().__init__(weight_policy)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_nodes = max_nodes
        self.tree: dict[int, list[int]] = {}
        self.size: list[int] = []
        self.block_size = 16

    def add_replica(self, rid: str, block_size: int, num_blocks: int) -> None:
        super().add_replica(rid, block_size, num_blocks)
        self.size.append(0)
        self.block_size = block_size

    def choose(self, h: Handle, now: float) -> int:
        load = self.load
        hi, lo = max(load), min(load)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            i = load.index(lo)
        else:
            depth, owner = self._match(h.hashes)
            prompt = h.prompt_tokens
            if prompt and depth * self.block_size / prompt > self.cache_threshold:
                i = owner
            else:
                i = self.size.index(min(self.size))
        self._insert(h.hashes, i)
        return i

    def _match(self, hashes: tuple[int, ...]) -> tuple[int, int]:
        tree, depth, owner = self.tree, 0, -1
        for h in hashes:
            owners = tree.get(h)
            if not owners:
                break
            depth += 1
            owner = owners[-1]
        return depth, owner

    def _insert(self, hashes: tuple[int, ...], i: int) -> None:
        tree = self.tree
        for h in hashes:
            owners = tree.pop(h, None)
            if owners is None:
                owners = [i]
                self.size[i] += 1
            elif i in owners:
                owners.remove(i)
                owners.append(i)
            else:
                owners.append(i)
                self.size[i] += 1
            tree[h] = owners
        while len(tree) > self.max_nodes:
            old = next(iter(tree))
            for j in tree.pop(old):
                self.size[j] -= 1
