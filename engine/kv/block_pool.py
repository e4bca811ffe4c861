"""The pool of fixed-size KV blocks: reference counts, an LRU free queue and the prefix-hash map.

A freed block keeps its hash and stays findable until it is handed out again, so a later request
with the same prefix revives it instead of recomputing (vLLM v1's design). The free queue is an
OrderedDict used as a doubly linked list: O(1) pop from the LRU end, append at the MRU end, and
removal from the middle when a cached block is hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache


@dataclass(frozen=True, slots=True)
class BlockPoolStats:
    num_blocks: int
    num_used: int  # referenced by at least one request
    num_cached: int  # registered under a prefix hash (used or not)
    num_free: int  # ref count 0 (cached ones included: they are reclaimable)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, reviving those that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the MRU end of the free queue, in the
        given order (callers pass a request's blocks tail first, so its tail is evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable by its prefix hash. When another block already holds the same
        content (two requests computed it concurrently) the first stays the canonical one."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)

    def unregister(self, block: KVBlock) -> None:
        """Forget a block's hash: its content is not what the hash says (never computed)."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_blocks=len(self.blocks),
            num_used=sum(1 for b in self.blocks if b.ref_cnt > 0),
            num_cached=len(self._cached),
            num_free=len(self._free),
        )

    def check_integrity(self) -> None:
        """Every block is either referenced or in the free queue, never both; hashes consistent."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref count {block.ref_cnt}"
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref {block.ref_cnt}, in free queue {in_free}"
            )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"block {block.block_id} hash map out of sync"
