"""The simulation runs the engine's own scheduler: on a small trace its schedule equals the real
engine's step by step, prefix hits and preemptions included; its clock follows the step-time
function it is given."""

from __future__ import annotations

import time

import pytest

from capacity.perf import StepShape
from capacity.simulate import EngineShape, Load, prompt_token_ids, simulate
from engine import LLM, SamplingParams
from tests.engine.tiny_models import build_tiny_model
from workload.trace import TraceRecord

VOCAB = 384  # tiny_models' vocab_size

TRACE = [
    TraceRecord(0, 40, 6, [7]),
    TraceRecord(0, 55, 3, [7]),  # shares the first 40 tokens' block content with the first
    TraceRecord(0, 23, 9, [8]),
    TraceRecord(0, 70, 4, [9]),
    TraceRecord(0, 33, 7, [7]),
    TraceRecord(0, 61, 5, [10]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-sim"))


def _engine_schedule(model_dir, shape: EngineShape) -> tuple[list, int]:
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=shape.block_size,
        num_kv_blocks=shape.num_blocks,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        enable_prefix_caching=shape.enable_prefix_caching,
    )
    core = llm.engine.core
    schedule, steps = core.scheduler.schedule, []

    def recording():
        out = schedule()
        if out.scheduled:
            steps.append([(s.request.request_id, s.num_tokens) for s in out.scheduled])
        return out

    core.scheduler.schedule = recording
    now = time.time()
    for i, record in enumerate(TRACE):
        params = SamplingParams(temperature=0.0, max_tokens=record.output_length, ignore_eos=True)
        prompt = prompt_token_ids(record, VOCAB, owner=i)
        core.add_request(str(i), prompt, params, arrival_time=now)
    while core.has_unfinished():
        core.step()
    return steps, core.scheduler.num_preemptions


@pytest.mark.parametrize(
    "shape",
    [
        EngineShape(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=48, max_model_len=128),
        # A pool too small for all of them at once: preemption by recompute.
        EngineShape(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
        EngineShape(
            num_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            max_model_len=128,
            enable_prefix_caching=False,
        ),
    ],
)
def test_simulated_schedule_equals_the_engines(model_dir, shape):
    real, real_preemptions = _engine_schedule(model_dir, shape)
    sim = simulate(TRACE, lambda s: 0.01, shape, batch=True, keep_schedule=True, vocab=VOCAB)
    # The simulation's prompts come from the same function with the engine's vocabulary.
    assert sim.schedule == real
    assert sim.preemptions == real_preemptions
    assert sim.steps == len(real)
    if shape.num_blocks == 6:
        assert real_preemptions > 0


def test_clock_and_latencies_follow_the_step_time():
    shape = EngineShape(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=512)
    one = TraceRecord(0, 30, 5, [1])
    result = simulate([one], lambda s: 0.5 if s.num_batched_tokens > 1 else 0.1, shape)
    (req,) = result.requests
    # One prefill step (0.5 s, samples the first token), then four decode steps (0.1 s each).
    assert req.ttft_s == pytest.approx(0.5) and req.e2e_s == pytest.approx(0.9)
    assert req.tpot_s == pytest.approx(0.1) and result.makespan_s == pytest.approx(0.9)


def test_arrivals_follow_the_trace_clock():
    shape = EngineShape(num_blocks=64)
    trace = [TraceRecord(0, 10, 2, [1]), TraceRecord(5000, 10, 2, [2])]
    result = simulate(trace, lambda s: 0.1, shape, time_scale=2.0)
    first, second = result.requests
    assert second.arrival_s == pytest.approx(2.5)  # 5 s of trace at twice the speed
    assert first.finish_s == pytest.approx(0.2) and second.finish_s == pytest.approx(2.7)
    assert result.makespan_s == pytest.approx(2.7)


def test_shapes_count_tokens_rows_and_attention():
    seen: list[StepShape] = []
    shape = EngineShape(num_blocks=64, max_num_batched_tokens=512, enable_prefix_caching=False)
    simulate([TraceRecord(0, 10, 3, [1])], lambda s: seen.append(s) or 0.01, shape)
    assert [s.num_batched_tokens for s in seen] == [10, 1, 1]
    assert [s.sampled_rows for s in seen] == [1, 1, 1]
    assert [s.attention_pairs for s in seen] == [55, 11, 12]
    assert [s.context_tokens for s in seen] == [10, 11, 12]


def test_thousands_of_requests_in_seconds():
    trace = [TraceRecord(0, 400 + (i * 37) % 300, 50 + (i * 13) % 200, [0, i]) for i in range(2000)]
    shape = EngineShape(num_blocks=20000, max_num_seqs=128, max_num_batched_tokens=4096)
    start = time.perf_counter()
    result = simulate(trace, lambda s: 0.02, shape, batch=True)
    assert all(r.finish_s is not None for r in result.requests)
    assert time.perf_counter() - start < 60  # a bound for a loaded 2-core CI machine


def test_a_trace_without_hash_ids_shares_nothing():
    """Unknown sharing means unique prompts. Records without hash_ids all got the same prompt
    before, and the prefix cache then computed each prompt once: 2.07x throughput on
    2048-in / 128-out, as the planner's published-results check found."""
    shape = EngineShape(num_blocks=4096, max_num_seqs=8, max_num_batched_tokens=2048)

    def step(s: StepShape) -> float:
        return 1e-3 + 1e-5 * s.num_batched_tokens

    unknown = [TraceRecord(0, 2048, 128) for _ in range(8)]
    unique = [
        TraceRecord(0, 2048, 128, [10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3]) for i in range(8)
    ]
    shared = [TraceRecord(0, 2048, 128, [1, 2, 3, 4]) for _ in range(8)]
    times = {
        name: simulate(trace, step, shape, batch=True).makespan_s
        for name, trace in (("unknown", unknown), ("unique", unique), ("shared", shared))
    }
    assert times["unknown"] == times["unique"]
    assert times["shared"] < 0.8 * times["unique"]  # the cache still works when it should
    first, second = (prompt_token_ids(r, 32000, owner=i) for i, r in enumerate(unknown[:2]))
    assert first[:16] != second[:16]


def test_hash_ids_are_blocks_of_the_traces_block_size():
    """`workload export --block-size 16` writes 16-token ids. Two prompts sharing one of them
    share 16 tokens, not 512 (hash_ids were always read as 512-token blocks): the prefix cache
    hits one 16-token KV block, and prefill computes the rest."""
    first = TraceRecord(0, 600, 8, list(range(38)), block_size=16)
    second = TraceRecord(0, 600, 8, [0, *range(100, 137)], block_size=16)
    a, b = (prompt_token_ids(r, 32000, owner=i) for i, r in enumerate((first, second)))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared == 16
    # As 512-token blocks (Mooncake's, a record without block_size) the same ids share 512.
    mooncake = [TraceRecord(0, 600, 8, [0, 1]), TraceRecord(0, 600, 8, [0, 2])]
    c, d = (prompt_token_ids(r, 32000, owner=i) for i, r in enumerate(mooncake))
    assert c[:512] == d[:512] and c[512] != d[512]
    shape = EngineShape(num_blocks=512, max_num_seqs=1, max_num_batched_tokens=1024)
    computed = []

    def step(s: StepShape) -> float:
        computed.append(s.num_batched_tokens)
        return 0.01

    simulate([first, second], step, shape, batch=True)
    # One at a time (max_num_seqs 1): 600 prefill tokens, 7 decode steps, then 600 - 16.
    assert computed == [600, *[1] * 7, 600 - 16, *[1] * 7]


def _constant_step(_: StepShape) -> float:
    return 0.01


_SMALL = EngineShape(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256)


def test_trace_mode_honours_arrivals():
    """Three requests 10 s apart take 20 s and more, not the 1.3 s of sending them at once."""
    trace = [TraceRecord(t * 10_000.0, 64, 8, [t]) for t in range(3)]
    timed = simulate(trace, _constant_step, _SMALL, load=Load("trace"))
    at_once = simulate(trace, _constant_step, _SMALL, load=Load("batch"))
    assert [r.arrival_s for r in timed.requests] == [0.0, 10.0, 20.0]
    assert timed.makespan_s >= 20.0 > 1.0 > at_once.makespan_s


def test_poisson_mode_draws_seeded_arrivals_at_the_rate():
    trace = [TraceRecord(0, 32, 4, [i]) for i in range(400)]
    run = simulate(trace, _constant_step, _SMALL, load=Load("poisson", rate=20.0, seed=3))
    again = simulate(trace, _constant_step, _SMALL, load=Load("poisson", rate=20.0, seed=3))
    arrivals = [r.arrival_s for r in run.requests]
    assert arrivals == [r.arrival_s for r in again.requests]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.15)
    assert run.makespan_s >= arrivals[-1]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_mode_keeps_at_most_that_many_in_flight(concurrency):
    trace = [TraceRecord(0, 32, 5, [i]) for i in range(9)]
    load = Load("concurrency", concurrency=concurrency)
    run = simulate(trace, _constant_step, _SMALL, load=load, keep_schedule=True)
    for step in run.schedule:
        assert len({rid for rid, _ in step}) <= concurrency
    if concurrency == 1:  # one after another: each is sent as the previous one ends
        for before, after in zip(run.requests, run.requests[1:]):
            assert after.arrival_s == before.finish_s


@pytest.mark.parametrize(
    "load", [{"mode": "poisson"}, {"mode": "concurrency"}, {"mode": "sometimes"}]
)
def test_a_load_without_its_number_is_refused(load):
    with pytest.raises(ValueError, match="--"):
        Load(**load)


@pytest.mark.parametrize("mode", ["batch", "poisson", "concurrency"])
def test_the_http_front_end_hands_requests_over_one_after_another(mode):
    """A serial front end of 1 s per request: ten requests sent at once reach the scheduler at
    1, 2, ... 10 s (the run takes at least 10 s, each TTFT counts its wait); without it they
    all start at once."""
    trace = [TraceRecord(0, 32, 4, [i]) for i in range(10)]
    load = {
        "batch": Load("batch"),
        "poisson": Load("poisson", rate=1000.0),
        "concurrency": Load("concurrency", concurrency=10),
    }[mode]
    fronted = simulate(trace, _constant_step, _SMALL, load=load, request_cost_s=1.0)
    direct = simulate(trace, _constant_step, _SMALL, load=load)
    assert fronted.makespan_s >= 10.0 > 1.0 > direct.makespan_s
    firsts = sorted(r.first_token_s for r in fronted.requests)
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(firsts, firsts[1:]))
    assert min(r.ttft_s for r in fronted.requests) >= 1.0
    assert all(r.output_length == 4 and r.finish_s is not None for r in fronted.requests)


def test_a_front_end_faster_than_the_arrivals_costs_only_its_own_time():
    """Requests 10 s apart through a 0.5 s front end: each waits 0.5 s, none queues."""
    trace = [TraceRecord(t * 10_000.0, 32, 4, [t]) for t in range(3)]
    run = simulate(trace, _constant_step, _SMALL, load=Load("trace"), request_cost_s=0.5)
    plain = simulate(trace, _constant_step, _SMALL, load=Load("trace"))
    for a, b in zip(run.requests, plain.requests):
        assert a.ttft_s == pytest.approx(b.ttft_s + 0.5)
