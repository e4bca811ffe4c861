"""BlockPool and KVCacheManager: ref counts, LRU eviction, chained prefix hits, stats, and a
stateful property test that no block is ever leaked or owned twice."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

_seq = itertools.count()


def make_request(tokens: list[int], request_id: str | None = None, **params) -> Request:
    n = next(_seq)
    return Request(
        request_id=request_id or f"r{n}",
        prompt_token_ids=list(tokens),
        params=SamplingParams(**params),
        max_tokens=16,
        arrival_time=0.0,
        arrival_seq=n,
    )


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> int:
    """Prefix lookup + allocation as the scheduler does it; returns the cached token count."""
    computed, num_cached = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_cached
    assert kv.allocate_slots(request, num_new, computed)
    request.num_computed_tokens = num_cached + num_new
    return num_cached


def free_ids(pool: BlockPool) -> list[int]:
    """The free queue, LRU end first."""
    return list(pool._free)


# ----- BlockPool -------------------------------------------------------------------------------


def test_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free == 1
    pool.touch(blocks[:1])  # a second owner
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 0, 0]
    assert pool.num_free == 3
    pool.free(blocks[:1])
    assert pool.num_free == 4
    pool.check_integrity()
    assert pool.stats().num_used == 0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_double_free_is_caught():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([block])


def test_least_recently_freed_is_reused_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    order = [2, 0, 3, 1]
    pool.free([blocks[i] for i in order])
    assert free_ids(pool) == order
    assert [b.block_id for b in pool.allocate(4)] == order


def test_freed_block_keeps_hash_and_is_revived_on_hit():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.register(a, b"h-a")
    pool.free([b, a])
    assert a.block_hash == b"h-a"
    assert pool.lookup(b"h-a") is a
    assert pool.stats().num_cached == 1
    pool.touch([a])  # a hit takes it out of the free queue
    assert a.ref_cnt == 1
    assert a.block_id not in free_ids(pool)
    pool.check_integrity()
    # Reallocation takes the LRU free blocks (2, then b) and never the revived one.
    assert [x.block_id for x in pool.allocate(2)] == [2, b.block_id]
    assert pool.lookup(b"h-a") is a


def test_reused_block_loses_its_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.register(a, b"h")
    pool.free([a])
    (again,) = pool.allocate(1)
    assert again is a
    assert a.block_hash is None
    assert pool.lookup(b"h") is None
    assert pool.stats().num_cached == 0


def test_duplicate_content_keeps_first_block_canonical():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, b"same")
    pool.register(b, b"same")
    assert pool.lookup(b"same") is a
    pool.free([a, b])
    pool.allocate(1)  # reuses a (the LRU): the hash disappears with it
    assert pool.lookup(b"same") is None
    pool.check_integrity()


# ----- KVCacheManager --------------------------------------------------------------------------

BS = 4


def kv_manager(num_blocks: int = 8, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)


def test_request_blocks_and_free():
    kv = kv_manager()
    r = make_request(range(10))
    assert admit(kv, r) == 0
    assert kv.block_ids(r.request_id) == [0, 1, 2]
    stats = kv.stats()
    assert (stats.num_used, stats.num_cached, stats.num_free) == (3, 2, 5)  # 2 full blocks cached
    kv.free(r)
    assert kv.block_ids(r.request_id) == []
    stats = kv.stats()
    assert (stats.num_used, stats.num_cached, stats.num_free) == (0, 2, 8)
    kv.check_integrity()


def test_free_puts_tail_first_so_tail_is_evicted_before_head():
    kv = kv_manager(num_blocks=4)
    prompt = list(range(2, 15))  # 13 tokens: 3 full blocks + 1 token
    a = make_request(prompt)
    admit(kv, a)
    assert kv.block_ids(a.request_id) == [0, 1, 2, 3]
    kv.free(a)
    assert free_ids(kv.pool) == [3, 2, 1, 0]  # tail first: the tail is the LRU end
    # One new block evicts the partial tail (3), a second one the last full block (2).
    other = make_request([50] * 8)
    admit(kv, other)
    assert kv.block_ids(other.request_id) == [3, 2]
    # The same prompt now hits the head: blocks 0 and 1.
    again = make_request(prompt)
    computed, num_cached = kv.get_computed_blocks(again)
    assert [b.block_id for b in computed] == [0, 1]
    assert num_cached == 2 * BS


def test_prefix_hits_are_chained():
    kv = kv_manager(num_blocks=16)
    a0, a1, a2 = [2] * BS, [3] * BS, [4] * BS
    first = make_request(a0 + a1 + a2 + [5])
    admit(kv, first)
    kv.free(first)

    same = make_request(a0 + a1 + a2 + [6])
    assert kv.get_computed_blocks(same)[1] == 3 * BS
    # Same later blocks behind a different first block: hashes chain, so no hit at all.
    other_head = make_request([9] * BS + a1 + a2 + [5])
    computed, num_cached = kv.get_computed_blocks(other_head)
    assert (computed, num_cached) == ([], 0)
    # A different second block keeps the first hit only.
    other_mid = make_request(a0 + [9] * BS + a2 + [5])
    computed, num_cached = kv.get_computed_blocks(other_mid)
    assert len(computed) == 1 and num_cached == BS


@pytest.mark.parametrize("k", [1, 2, 3])
def test_hit_is_capped_so_last_token_is_computed(k):
    kv = kv_manager(num_blocks=16)
    prompt = [7, 8, 9, 10] * k + [11]
    admit(kv, make_request(prompt))
    # Exactly k full blocks: k - 1 of them hit, the last block is recomputed for its logits.
    exact = make_request(prompt[: k * BS])
    assert kv.get_computed_blocks(exact)[1] == (k - 1) * BS
    longer = make_request(prompt)
    assert kv.get_computed_blocks(longer)[1] == k * BS


def test_hit_blocks_are_shared_and_ref_counted():
    kv = kv_manager(num_blocks=8)
    prompt = list(range(2, 11))  # 9 tokens: 2 full blocks + 1
    a, b = make_request(prompt), make_request(prompt)
    admit(kv, a)
    assert admit(kv, b) == 2 * BS
    ids_a, ids_b = kv.block_ids(a.request_id), kv.block_ids(b.request_id)
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]
    assert [kv.pool.blocks[i].ref_cnt for i in ids_a[:2]] == [2, 2]
    kv.check_integrity()
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in ids_a[:2]] == [1, 1]
    kv.free(b)
    kv.check_integrity()
    assert kv.stats().num_used == 0


def test_no_hits_with_prefix_caching_off_or_prompt_logprobs():
    kv = kv_manager(prefix=False)
    prompt = list(range(2, 11))
    admit(kv, make_request(prompt))
    assert kv.stats().num_cached == 0
    assert kv.get_computed_blocks(make_request(prompt))[1] == 0
    kv.record_prefix_query(9, 0)
    assert (kv.prefix_stats.queried_tokens, kv.prefix_stats.hit_tokens) == (0, 0)

    kv = kv_manager()
    admit(kv, make_request(prompt))
    assert kv.get_computed_blocks(make_request(prompt, prompt_logprobs=1))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt))[1] == 2 * BS


def _snapshot(kv: KVCacheManager):
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.pool.blocks],
        free_ids(kv.pool),
        dict(kv.pool._cached),
        kv.stats(),
    )


def test_allocate_slots_short_returns_false_and_changes_nothing():
    kv = kv_manager(num_blocks=4)
    holder = make_request(list(range(2, 14)))  # 12 tokens: 3 blocks
    admit(kv, holder)
    before = _snapshot(kv)
    r = make_request(list(range(20, 29)))  # needs 3 blocks, 1 free
    assert not kv.allocate_slots(r, 9)
    assert _snapshot(kv) == before
    assert kv.block_ids(r.request_id) == []
    # Growing a running request past the pool also fails cleanly.
    holder.prompt_token_ids += [40] * 8
    assert not kv.allocate_slots(holder, 8)
    assert _snapshot(kv) == before
    assert kv.block_ids(holder.request_id) == [0, 1, 2]
    kv.check_integrity()


def test_allocate_slots_counts_revived_hits_against_free_blocks():
    kv = kv_manager(num_blocks=4)
    first = make_request(list(range(2, 11)))  # 9 tokens: blocks 0, 1 full and 2
    admit(kv, first)
    kv.free(first)
    # 17 tokens: 2 hits (both sitting in the free queue) + 3 new blocks > 4 - 2.
    r = make_request(list(range(2, 10)) + [30] * 9)
    computed, num_cached = kv.get_computed_blocks(r)
    assert num_cached == 2 * BS
    before = _snapshot(kv)
    assert not kv.allocate_slots(r, r.num_tokens - num_cached, computed)
    assert _snapshot(kv) == before
    # 13 tokens fits exactly: 2 revived + 2 new.
    r = make_request(list(range(2, 10)) + [30] * 5)
    assert admit(kv, r) == 2 * BS
    assert kv.stats().num_free == 0
    kv.check_integrity()


def test_decode_grows_block_table_one_block_at_a_time():
    kv = kv_manager(num_blocks=8)
    r = make_request([3] * 7)
    admit(kv, r)
    assert len(kv.block_ids(r.request_id)) == 2
    for _ in range(6):
        r.output_token_ids.append(5)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert len(kv.block_ids(r.request_id)) == kv.blocks_needed(r.num_tokens)
    # Full blocks made of output tokens are registered too: 13 tokens = 3 full blocks.
    assert kv.stats().num_cached == 3
    kv.free(r)
    follow = make_request(r.all_token_ids + [6])
    assert kv.get_computed_blocks(follow)[1] == 3 * BS


def test_prefix_stats_and_reset():
    kv = kv_manager(num_blocks=8)
    prompt = list(range(2, 11))
    kv.record_prefix_query(9, 0)
    first = make_request(prompt)
    admit(kv, first)
    kv.free(first)
    kv.record_prefix_query(9, 8)
    assert (kv.prefix_stats.queried_tokens, kv.prefix_stats.hit_tokens) == (18, 8)

    holder = make_request([60] * 8)
    admit(kv, holder)  # 2 more cached blocks, still referenced
    assert kv.stats().num_cached == 4
    kv.reset_prefix_cache()
    # Unreferenced cached blocks forget their hash; referenced ones stay findable.
    assert kv.stats().num_cached == 2
    assert kv.get_computed_blocks(make_request(prompt))[1] == 0
    assert kv.get_computed_blocks(make_request([60] * 9))[1] == 2 * BS
    kv.check_integrity()


def test_usage():
    kv = kv_manager(num_blocks=4)
    assert kv.usage() == 0.0
    r = make_request([2] * 8)
    admit(kv, r)
    assert kv.usage() == 0.5
    kv.free(r)
    assert kv.usage() == 0.0


# ----- stateful property test ------------------------------------------------------------------

NUM_BLOCKS = 10
ALPHABET = [2, 3]  # two symbols: prefixes repeat often


class KVMachine(RuleBasedStateMachine):
    """Requests arrive, compute chunks, decode, and leave. A shadow copy of the KV contents
    (block id -> token per slot, written when a chunk is computed) checks that every prefix hit
    points at blocks holding exactly the request's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.content: dict[int, list[int | None]] = {}

    def _snapshot(self):
        return _snapshot(self.kv)

    def _write(self, request: Request, start: int, end: int) -> None:
        table = self.kv.block_ids(request.request_id)
        tokens = request.all_token_ids
        for p in range(start, end):
            self.content.setdefault(table[p // BS], [None] * BS)[p % BS] = tokens[p]

    def _check_context(self, request: Request) -> None:
        table = self.kv.block_ids(request.request_id)
        tokens = request.all_token_ids
        for p in range(request.num_computed_tokens):
            assert self.content[table[p // BS]][p % BS] == tokens[p], (request.request_id, p)

    @rule(
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=22),
        chunk=st.integers(1, 24),
    )
    def new_request(self, prompt: list[int], chunk: int) -> None:
        request = make_request(prompt)
        computed, num_cached = self.kv.get_computed_blocks(request)
        assert num_cached < request.num_tokens and num_cached % BS == 0
        num_new = min(chunk, request.num_tokens - num_cached)
        before = self._snapshot()
        if not self.kv.allocate_slots(request, num_new, computed):
            assert self._snapshot() == before
            self.kv.free(request)  # drops the empty table entry, as a finished request would
            return
        for block_id in self.kv.block_ids(request.request_id)[len(computed) :]:
            self.content[block_id] = [None] * BS  # fresh blocks hold nothing yet
        request.num_computed_tokens = num_cached
        self._write(request, num_cached, num_cached + num_new)
        request.num_computed_tokens += num_new
        self._check_context(request)
        self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), chunk=st.integers(1, 24), token=st.sampled_from(ALPHABET))
    def step_request(self, index: int, chunk: int, token: int) -> None:
        """One step of a live request: the next prompt chunk, or a decode of a sampled token."""
        request = list(self.live.values())[index % len(self.live)]
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        old_table = self.kv.block_ids(request.request_id)
        before = self._snapshot()
        if not self.kv.allocate_slots(request, num_new):
            assert self._snapshot() == before
            assert self.kv.block_ids(request.request_id) == old_table
            return
        table = self.kv.block_ids(request.request_id)
        assert table[: len(old_table)] == old_table
        for block_id in table[len(old_table) :]:
            self.content[block_id] = [None] * BS
        start = request.num_computed_tokens
        self._write(request, start, start + num_new)
        request.num_computed_tokens += num_new
        self._check_context(request)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def free_request(self, index: int) -> None:
        request = list(self.live.values())[index % len(self.live)]
        self.kv.free(request)
        del self.live[request.request_id]
        assert self.kv.block_ids(request.request_id) == []

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def integrity(self) -> None:
        kv = self.kv
        kv.check_integrity()
        owners: dict[int, list[str]] = {}
        for rid, request in self.live.items():
            table = kv.block_ids(rid)
            assert len(table) == len(set(table)), f"{rid} holds a block twice: {table}"
            assert len(table) == kv.blocks_needed(request.num_computed_tokens)
            for i, block_id in enumerate(table):
                owners.setdefault(block_id, []).append(rid)
                if i >= request.num_computed_tokens // BS:  # a block still being filled
                    assert kv.pool.blocks[block_id].block_hash is None
        for block_id, rids in owners.items():
            block = kv.pool.blocks[block_id]
            assert block.ref_cnt == len(rids)
            if len(rids) > 1:  # only full, cached blocks are shared
                assert block.block_hash is not None, (block_id, rids)
        stats = kv.stats()
        assert stats.num_used + stats.num_free == NUM_BLOCKS
        assert stats.num_used == len(owners)

    def teardown(self) -> None:
        for request in list(self.live.values()):
            self.kv.free(request)
        self.live.clear()
        self.kv.check_integrity()
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == 0
        stats = self.kv.stats()
        assert (stats.num_used, stats.num_free) == (0, NUM_BLOCKS)
        assert stats.num_cached <= NUM_BLOCKS


KVMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase
