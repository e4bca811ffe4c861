"""Scheduler + KVCacheManager without a model: the forward is faked (every request that reaches the
end of its tokens samples a fixed non-EOS token). Budgets, ordering, chunked prefill, preemption,
finish/abort, and a property test over random arrivals, aborts and preemptions."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 1
TOKEN = 5  # what the fake model always samples: never EOS


class Harness:
    """A scheduler over a KV pool, a fake forward, and a shadow of the KV contents that checks
    every scheduled request attends to blocks holding exactly its own tokens."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_model_len: int = 1024,
        prefix: bool = True,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.sched = Scheduler(self.config, self.kv)
        self.block_size = block_size
        self.seq = itertools.count()
        self.content: dict[int, list[int | None]] = {}
        self.finished: list[Request] = []
        self.sample = lambda request: TOKEN

    def add(
        self, rid: str, prompt: int | list[int], max_tokens: int = 4, priority: int = 0
    ) -> Request:
        seq = next(self.seq)
        # An int asks for that many tokens unique to the request (no prefix hits).
        tokens = (
            [1000 * (seq + 1) + i for i in range(prompt)] if isinstance(prompt, int) else prompt
        )
        request = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            params=SamplingParams(max_tokens=max_tokens),
            max_tokens=max_tokens,
            arrival_time=0.0,
            arrival_seq=seq,
            priority=priority,
            eos_token_ids=frozenset({EOS}),
        )
        self.sched.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._check_step(out)
        self._forward(out)
        sampled = {
            s.request.request_id: [self.sample(s.request)] for s in out.scheduled if s.samples
        }
        self.finished += self.sched.update(out, sampled)
        self._check_ownership()
        return out

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outs = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return outs
            outs.append(self.step())
        raise AssertionError(f"not finished after {max_steps} steps")

    def _check_step(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.config.max_num_seqs
        assert len(self.sched.running) <= self.config.max_num_seqs
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"scheduled twice: {ids}"
        for s in out.scheduled:
            r = s.request
            assert r.status == RequestStatus.RUNNING and r in self.sched.running
            assert 0 < s.num_tokens <= r.num_tokens - r.num_computed_tokens
            table = self.kv.block_ids(r.request_id)
            assert len(table) >= self.kv.blocks_needed(r.num_computed_tokens + s.num_tokens)
        for r in out.preempted:
            assert r.status == RequestStatus.PREEMPTED and r in self.sched.waiting
            assert self.kv.block_ids(r.request_id) == [] and r.num_computed_tokens == 0
        assert not set(map(id, self.sched.running)) & set(map(id, self.sched.waiting))
        assert [r.sort_key for r in self.sched.waiting] == sorted(
            r.sort_key for r in self.sched.waiting
        )

    def _check_ownership(self) -> None:
        """Ref counts match owners; no request holds a block twice; only cached full blocks are
        shared; requests outside `running` hold nothing."""
        self.kv.check_integrity()
        owners: dict[int, int] = {}
        for r in self.sched.running:
            table = self.kv.block_ids(r.request_id)
            assert len(table) == len(set(table)), f"{r.request_id} holds a block twice: {table}"
            for block_id in table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block_id, count in owners.items():
            block = self.kv.pool.blocks[block_id]
            assert block.ref_cnt == count
            assert count == 1 or block.block_hash is not None, f"block {block_id} shared"
        assert self.kv.stats().num_used == len(owners)
        for r in self.sched.waiting:
            assert self.kv.block_ids(r.request_id) == []

    def _forward(self, out: SchedulerOutput) -> None:
        """Write every scheduled token's K/V (here: the token id) into its slot, then check each
        request's whole context is what it should be, as attention would read it."""
        bs = self.block_size
        for s in out.scheduled:
            r = s.request
            table = self.kv.block_ids(r.request_id)
            tokens = r.all_token_ids
            for p in range(r.num_computed_tokens, r.num_computed_tokens + s.num_tokens):
                self.content.setdefault(table[p // bs], [None] * bs)[p % bs] = tokens[p]
        for s in out.scheduled:
            r = s.request
            table = self.kv.block_ids(r.request_id)
            tokens = r.all_token_ids
            for p in range(r.num_computed_tokens + s.num_tokens):
                got = self.content.get(table[p // bs], [None] * bs)[p % bs]
                assert got == tokens[p], (
                    f"{r.request_id} position {p}: block {table[p // bs]} holds {got}, "
                    f"expected {tokens[p]}"
                )

    def assert_all_free(self) -> None:
        self.kv.check_integrity()
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == 0
        stats = self.kv.stats()
        assert (stats.num_used, stats.num_free) == (0, stats.num_blocks)
        assert not self.sched.running and not self.sched.waiting


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def test_single_request_runs_to_max_tokens():
    h = Harness()
    r = h.add("a", 6, max_tokens=5)
    outs = h.run()
    assert [plan(o) for o in outs] == [[("a", 6)]] + [[("a", 1)]] * 4
    assert r.output_token_ids == [TOKEN] * 5
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_cached_tokens == 0
    h.assert_all_free()


def test_token_budget_and_max_num_seqs():
    h = Harness(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(7):
        h.add(f"r{i}", 4 + i, max_tokens=3)
    outs = h.run()  # the harness asserts both limits on every step
    assert max(len(o.scheduled) for o in outs) == 3
    assert max(o.num_batched_tokens for o in outs) == 10
    assert all(len(r.output_token_ids) == 3 for r in h.finished)
    assert len(h.finished) == 7
    h.assert_all_free()


def test_decodes_of_running_requests_come_before_new_prefills():
    h = Harness(max_num_batched_tokens=64)
    h.add("a", 5, max_tokens=6)
    h.add("b", 3, max_tokens=6)
    assert plan(h.step()) == [("a", 5), ("b", 3)]
    h.add("c", 20)
    assert plan(h.step()) == [("a", 1), ("b", 1), ("c", 20)]


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    h = Harness(max_num_batched_tokens=16)
    h.add("d", 4, max_tokens=10)
    assert plan(h.step()) == [("d", 4)]
    long = h.add("long", 40, max_tokens=2)
    steps = [plan(h.step()) for _ in range(3)]
    assert steps == [[("d", 1), ("long", 15)], [("d", 1), ("long", 15)], [("d", 1), ("long", 10)]]
    assert long.output_token_ids == [TOKEN]  # sampled only when the last chunk was computed
    assert long.num_computed_tokens == 40
    assert plan(h.step()) == [("d", 1), ("long", 1)]
    h.run()
    h.assert_all_free()


def test_chunk_budget_left_after_decodes_goes_to_waiting():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", 30, max_tokens=1)
    h.add("b", 30, max_tokens=1)
    # The head of the queue takes the whole budget; b is admitted only when budget is left.
    assert plan(h.step()) == [("a", 8)]
    assert plan(h.step()) == [("a", 8)]
    assert plan(h.step()) == [("a", 8)]
    assert plan(h.step()) == [("a", 6), ("b", 2)]


def test_fcfs_admission_order():
    h = Harness(max_num_seqs=1)
    for rid in "abcd":
        h.add(rid, 3, max_tokens=2)
    outs = h.run()
    first_seen = list(dict.fromkeys(rid for o in outs for rid, _ in plan(o)))
    assert first_seen == list("abcd")
    assert [r.request_id for r in h.finished] == list("abcd")


def test_lower_priority_value_runs_first_then_arrival_order():
    h = Harness(max_num_seqs=1)
    h.add("p2", 3, priority=2)
    h.add("p0", 3, priority=0)
    h.add("p1", 3, priority=1)
    h.add("p0-late", 3, priority=0)
    h.run()
    assert [r.request_id for r in h.finished] == ["p0", "p0-late", "p1", "p2"]


def _fill_until_preemption(h: Harness, max_steps: int = 50) -> SchedulerOutput:
    for _ in range(max_steps):
        out = h.step()
        if out.preempted:
            return out
    raise AssertionError("no preemption happened")


def test_preemption_picks_latest_arrival_and_request_completes_later():
    # 6 blocks of 4: a and b each grow to 20 tokens (5 blocks) and cannot both fit.
    h = Harness(num_blocks=6, block_size=4, prefix=False)
    a = h.add("a", 8, max_tokens=12)
    b = h.add("b", [50 + i for i in range(8)], max_tokens=12)
    out = _fill_until_preemption(h)
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert h.sched.waiting == [b] and h.sched.running == [a]
    assert h.kv.block_ids("b") == [] and b.num_computed_tokens == 0
    assert all(s.request is not b for s in out.scheduled)
    assert h.sched.num_preemptions == 1
    outputs_before = len(b.output_token_ids)
    assert outputs_before > 0  # its outputs are kept and recomputed
    h.run()
    assert a.output_token_ids == [TOKEN] * 12 and b.output_token_ids == [TOKEN] * 12
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    h.assert_all_free()


def test_preemption_picks_lowest_priority_first():
    h = Harness(num_blocks=6, block_size=4, prefix=False)
    low = h.add("low", 8, max_tokens=12, priority=5)  # arrives first, but lower priority
    high = h.add("high", [50 + i for i in range(8)], max_tokens=12, priority=0)
    out = _fill_until_preemption(h)
    assert out.preempted == [low]
    assert high.status == RequestStatus.RUNNING
    h.run()
    assert len(low.output_token_ids) == len(high.output_token_ids) == 12
    h.assert_all_free()


def test_preempted_request_recomputes_from_prefix_cache():
    h = Harness(num_blocks=6, block_size=4, prefix=True)
    h.add("a", 8, max_tokens=12)
    b = h.add("b", [50 + i for i in range(8)], max_tokens=12)
    _fill_until_preemption(h)
    h.run()
    assert len(b.output_token_ids) == 12
    h.assert_all_free()


def test_finish_waiting_and_running_frees_blocks():
    h = Harness(max_num_seqs=1)
    run = h.add("run", 9, max_tokens=8)
    wait = h.add("wait", 9, max_tokens=8)
    h.step()
    assert run.status == RequestStatus.RUNNING and wait.status == RequestStatus.WAITING
    assert len(h.kv.block_ids("run")) == 3
    h.sched.finish(wait, RequestStatus.FINISHED_ABORTED)
    assert wait.status == RequestStatus.FINISHED_ABORTED and wait not in h.sched.waiting
    h.sched.finish(run, RequestStatus.FINISHED_ABORTED)
    assert run.status == RequestStatus.FINISHED_ABORTED
    assert h.kv.block_ids("run") == []
    h.sched.finish(run, RequestStatus.FINISHED_STOPPED)  # a second finish is a no-op
    assert run.status == RequestStatus.FINISHED_ABORTED
    assert not h.sched.has_unfinished()
    h.assert_all_free()


def test_eos_and_stop_tokens_finish_early():
    h = Harness()
    r = h.add("a", 4, max_tokens=10)
    h.step()
    out = h.sched.schedule()
    finished = h.sched.update(out, {"a": [EOS]})
    assert finished == [r] and r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [TOKEN, EOS]
    h.assert_all_free()


def test_max_model_len_finishes_with_length():
    h = Harness(max_model_len=10)
    r = h.add("a", 7, max_tokens=100)
    h.run()
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


# Regression: allocate_slots registers full blocks at allocation time; when _schedule_running then
# preempts a victim already scheduled this step, the victim's chunk is dropped, so its newly
# registered block is never written. free() must make such blocks unfindable, or a later request
# with that prefix reads stale KV.


def _unwritten_block_scenario(add, step):
    """X (prio 0) and L (prio 5) run; H (prio 3) arrives. In step 3 L's decode completes its
    block 0 (registered at allocation), then H's chunk finds no free block: L, already scheduled,
    is preempted, then H itself. F, a follow-up whose prompt extends L's tokens, arrives next."""
    add("X", [100 + i for i in range(7)], 10, 0)
    add("L", [200, 201], 10, 5)
    step()
    add("H", [300 + i for i in range(16)], 2, 3)
    step()
    return step()


def test_preempting_an_already_scheduled_request_leaves_no_unwritten_cached_block():
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=9, prefix=True)
    out = _unwritten_block_scenario(h.add, h.step)
    assert [r.request_id for r in out.preempted] == ["L", "H"]
    assert plan(out) == [("X", 1)]
    follow = h.sched.waiting[-1].all_token_ids + [7]  # L: prompt + 2 outputs
    h.add("F", follow, max_tokens=2, priority=0)
    h.step()  # the shadow check fails: F attends to slot 3 of L's block, never written


def test_unwritten_cached_block_changes_greedy_output_end_to_end(tmp_path):
    """The same scenario on a real (tiny) model: F's greedy tokens differ from F run alone."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.tiny_models import build_tiny_model

    path = build_tiny_model("llama", tmp_path)

    def engine() -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(path),
                block_size=4,
                num_kv_blocks=6,
                max_num_batched_tokens=9,
                max_model_len=64,
            )
        )

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def finish(e: LLMEngine) -> dict[str, list[int]]:
        done = {}
        while e.has_unfinished():
            done |= {o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished}
        return done

    mixed = engine()
    out = _unwritten_block_scenario(
        lambda rid, prompt, n, prio: mixed.add_request(rid, prompt, greedy(n), priority=prio),
        mixed.core.step,
    )
    assert [o.request.request_id for o in out] == ["X"]  # L and H were preempted
    follow = next(r for r in mixed.core.scheduler.waiting if r.request_id == "L").all_token_ids
    follow = follow + [7]
    mixed.add_request("F", follow, greedy(6), priority=0)
    alone = engine()
    alone.add_request("F", follow, greedy(6))
    assert finish(mixed)["F"] == finish(alone)["F"]


# ----- property test ---------------------------------------------------------------------------

BS = 4
NUM_BLOCKS = 10  # 40 token slots: a few requests at a time force preemptions

arrival = st.tuples(
    st.lists(st.sampled_from([2, 3]), min_size=1, max_size=24),  # repeating prefixes
    st.integers(1, 12),  # max_tokens
    st.integers(0, 2),  # priority
    st.none() | st.integers(0, 1000),  # continue an earlier request (a follow-up chat turn)
)
step_events = st.tuples(
    st.lists(arrival, max_size=3),
    st.lists(st.integers(0, 1000), max_size=1),  # abort this index of the unfinished, if any
)


def _sample(request: Request) -> int:
    # Outputs from the prompt alphabet, so later prompts can share prefixes with them; never EOS.
    return 2 + (request.num_tokens * 7 + len(request.prompt_token_ids)) % 2


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(step_events, min_size=1, max_size=25),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
)
def test_random_arrivals_aborts_and_preemptions(events, budget, max_num_seqs, prefix):
    h = Harness(
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        prefix=prefix,
    )
    h.sample = _sample
    requests: list[Request] = []
    aborted: set[str] = set()
    for arrivals, aborts in events:
        for prompt, max_tokens, priority, follow in arrivals:
            if follow is not None and requests:
                prompt = requests[follow % len(requests)].all_token_ids[: NUM_BLOCKS * BS - 8]
                prompt = prompt + [2, 3]
            # Never more than the whole pool (the engine rejects such requests up front).
            max_tokens = min(max_tokens, NUM_BLOCKS * BS - len(prompt))
            requests.append(h.add(f"r{len(requests)}", prompt, max_tokens, priority))
        for index in aborts:
            unfinished = [r for r in requests if not r.status.finished]
            if unfinished:
                victim = unfinished[index % len(unfinished)]
                h.sched.finish(victim, RequestStatus.FINISHED_ABORTED)
                aborted.add(victim.request_id)
                assert h.kv.block_ids(victim.request_id) == []
        if h.sched.has_unfinished():
            h.step()
    # Progress: every request ends within a bounded number of steps.
    total_tokens = sum(r.num_prompt_tokens + r.max_tokens for r in requests)
    h.run(max_steps=4 * total_tokens + 100)
    h.assert_all_free()
    for r in requests:
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH, r
            assert len(r.output_token_ids) == r.max_tokens
            assert EOS not in r.output_token_ids
