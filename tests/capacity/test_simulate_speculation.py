"""Speculative decoding in the simulation: drafts verified as 1 + k tokens in the engine's own
scheduler, accepted at the asked rate, outputs exactly their recorded lengths."""

from __future__ import annotations

import pytest

from capacity.perf import StepShape
from capacity.simulate import EngineShape, Speculation, simulate
from workload.trace import TraceRecord

ENGINE = EngineShape(num_blocks=400, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
TRACE = [TraceRecord(0, 40 + 3 * i, 60 + 5 * i) for i in range(6)]


def _run(speculation):
    shapes: list[StepShape] = []

    def step(shape: StepShape) -> float:
        shapes.append(shape)
        return 0.01

    return simulate(TRACE, step, ENGINE, batch=True, speculation=speculation), shapes


@pytest.mark.parametrize(("k", "rate"), [(1, 0.5), (4, 0.3), (4, 0.8), (7, 0.05)])
def test_per_draft_probability_gives_the_rate(k, rate):
    q = Speculation(k, rate).per_draft
    assert sum(q**j for j in range(1, k + 1)) / k == pytest.approx(rate, abs=1e-9)


def test_no_acceptance_costs_tokens_not_steps():
    base, base_shapes = _run(None)
    spec, spec_shapes = _run(Speculation(3, 0.0))
    assert spec.steps == base.steps
    assert [r.output_length for r in spec.requests] == [r.output_length for r in base.requests]
    # Each decode step verified 1 + 3 tokens per request (fewer near a request's end).
    assert sum(s.num_batched_tokens for s in spec_shapes) > 2 * sum(
        s.num_batched_tokens for s in base_shapes
    )


def test_acceptance_saves_steps_and_keeps_lengths():
    base, _ = _run(None)
    spec, shapes = _run(Speculation(4, 0.6, seed=1))
    assert spec.steps < 0.6 * base.steps
    assert all(r.finish_s is not None for r in spec.requests)
    assert [r.output_length for r in spec.requests] == [r.output_length for r in base.requests]
    assert spec.makespan_s < base.makespan_s
    again, _ = _run(Speculation(4, 0.6, seed=1))
    assert again.makespan_s == spec.makespan_s  # seeded


def test_tokens_per_verification_match_the_rate():
    # One long request: every decode step is one verification of 4 drafts.
    trace = [TraceRecord(0, 8, 4001)]
    engine = EngineShape(num_blocks=600, block_size=16, max_num_seqs=1,
                         max_num_batched_tokens=256, max_model_len=8192)  # fmt: skip
    spec = Speculation(4, 0.5, seed=3)
    result = simulate(trace, lambda s: 0.01, engine, batch=True, speculation=spec)
    q = spec.per_draft
    expected = 1 + sum(q**j for j in range(1, 5))  # tokens per verification
    decode_steps = result.steps - 1
    assert 4000 / decode_steps == pytest.approx(expected, rel=0.05)


def test_bad_speculation_settings_refused():
    with pytest.raises(ValueError, match="acceptance rate"):
        Speculation(4, 1.5)
    with pytest.raises(ValueError, match="draft token"):
        Speculation(0, 0.5)
    with pytest.raises(ValueError, match="proposal rate"):
        Speculation(4, 0.5, proposal_rate=0)
