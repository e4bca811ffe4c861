"""Per-request block tables on top of the block pool: prefix-cache lookup, allocation and free.

Block hashes chain: hash(block i) = H(hash(block i-1) || token ids of block i), so equal hashes mean
equal whole prefixes. BLAKE2b keeps this collision-safe even against crafted prompts (a collision
would leak another request's KV).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from engine.kv.block_pool import BlockPool, BlockPoolStats, KVBlock
from engine.request import Request

_ROOT_HASH = b"nightshift-kv-root"


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept as they change: the scheduler hands one to the
        # executor for every request of every step.
        self._ids: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: read it, do not keep it past the step)."""
        return self._ids.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request, in whole blocks. The hit is capped below the
        request's length so that at least its last token is computed (it yields the logits)."""
        if not self.enable_prefix_caching or request.needs_every_prompt_position:
            return [], 0
        hashes = self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_queried: int, num_hit: int) -> None:
        # Counted once per admission, not per lookup: a request that waits retries the lookup.
        if self.enable_prefix_caching:
            self.prefix_stats.queried_tokens += num_queried
            self.prefix_stats.hit_tokens += num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: list[KVBlock] | None = None,
        num_lookahead: int = 0,
    ) -> bool:
        """Give the request room for num_new_tokens more tokens (after its computed ones and the
        cache hits in `computed`), and num_lookahead slots past them (a draft model's guesses).
        Returns False, changing nothing, when the pool is short."""
        computed = computed or []
        blocks = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        wanted = self.blocks_needed(total + num_lookahead)
        num_new_blocks = max(0, wanted - len(blocks) - len(computed))
        # Hits that sit in the free queue stop being free once touched.
        reviving = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free - reviving:
            return False
        self.pool.touch(computed)
        fresh = self.pool.allocate(num_new_blocks)
        blocks.extend(computed)
        blocks.extend(fresh)
        ids = self._ids.setdefault(request.request_id, [])
        ids.extend([b.block_id for b in computed])
        ids.extend([b.block_id for b in fresh])
        if self.enable_prefix_caching:
            self._register_full_blocks(request, blocks, total)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first num_tokens tokens (speculative decoding's
        rejected drafts). They were never registered: registration stops at the request's known
        tokens, and a rejected draft's position is past them."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        keep = self.blocks_needed(num_tokens)
        if len(blocks) <= keep:
            return
        dropped = blocks[keep:]
        del blocks[keep:]
        del self._ids[request.request_id][keep:]
        assert keep >= self._num_registered.get(request.request_id, 0), "trimming a cached block"
        self.pool.free(reversed(dropped))

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._ids.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        # Blocks registered for a chunk that was never computed (a request preempted after being
        # scheduled in the same step) must not stay findable: their K/V was never written.
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.ref_cnt == 1:
                self.pool.unregister(block)
        self.pool.free(reversed(blocks))

    def forget_uncomputed(self, request: Request) -> None:
        """Unregister the request's blocks past its computed tokens, shared or not: a forward
        that failed never wrote their K/V, and a request that hit one this step failed too."""
        blocks = self._blocks.get(request.request_id, [])
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            self.pool.unregister(block)

    def _register_full_blocks(
        self, request: Request, blocks: list[KVBlock], num_tokens: int
    ) -> None:
        # Registering at allocation time is safe: K/V of every token of the step is written before
        # any attention reads it, so a request hitting these blocks later always sees them filled.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._update_hashes(request)
        for i in range(start, num_full):
            self.pool.register(blocks[i], hashes[i])
        self._num_registered[request.request_id] = num_full

    def _update_hashes(self, request: Request) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash_block(parent, request.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def usage(self) -> float:
        """Fraction of the pool referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def stats(self) -> BlockPoolStats:
        return self.pool.stats()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        for request_id, blocks in self._blocks.items():
            assert self._ids.get(request_id, []) == [b.block_id for b in blocks], request_id
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert owners.get(block.block_id, 0) == block.ref_cnt, (
                f"block {block.block_id}: ref {block.ref_cnt}, "
                f"owners {owners.get(block.block_id, 0)}"
            )
