"""Arrival schedules and prompt building, without a network."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workload.prompt_tokens import (
    LOW_ID,
    TextPrompts,
    TokenPrompts,
    check_block_size,
    load_tokenizer,
)
from workload.replay import (
    ReplayConfig,
    arrival_offsets,
    poisson_offsets,
    request_body,
    request_order,
    trace_offsets,
)
from workload.trace import BLOCK_TOKENS, TraceRecord


def test_poisson_gaps_have_mean_one_over_rate():
    offsets = poisson_offsets(201, rate=10.0, burstiness=1.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(gaps) == 200 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.2)  # 3 standard errors of 200 gaps
    # exponential gaps: coefficient of variation 1
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.2)
    assert poisson_offsets(201, 10.0, 1.0, seed=3) == offsets  # seeded: repeatable
    assert poisson_offsets(201, 10.0, 1.0, seed=4) != offsets


def test_burstiness_is_the_gamma_shape():
    bursty = np.diff(poisson_offsets(2001, rate=5.0, burstiness=0.25, seed=0))
    smooth = np.diff(poisson_offsets(2001, rate=5.0, burstiness=4.0, seed=0))
    for gaps, shape in ((bursty, 0.25), (smooth, 4.0)):
        assert gaps.mean() == pytest.approx(0.2, rel=0.15)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(shape), rel=0.15)


def test_infinite_rate_sends_everything_at_once():
    assert poisson_offsets(4, math.inf) == [0.0] * 4
    assert poisson_offsets(0, 1.0) == []


def test_trace_offsets_are_scaled_seconds_from_the_first_record():
    records = [TraceRecord(t, 10, 2) for t in (1000.0, 1500.0, 4000.0, 1200.0)]
    assert trace_offsets(records) == [0.0, 0.5, 3.0, 0.2]
    assert trace_offsets(records, time_scale=2.0) == [0.0, 0.25, 1.5, 0.1]
    config = ReplayConfig("http://x/v1", "m", mode="trace", time_scale=2.0)
    assert arrival_offsets(records, config) == [0.0, 0.25, 1.5, 0.1]
    assert request_order(records, config) == [0, 3, 1, 2]
    batch = ReplayConfig("http://x/v1", "m")
    assert arrival_offsets(records, batch) == [0.0] * 4
    assert request_order(records, batch) == [0, 1, 2, 3]


def test_config_checks():
    with pytest.raises(ValueError, match="concurrency"):
        ReplayConfig("u", "m", mode="concurrency").check()
    with pytest.raises(ValueError, match="rate"):
        ReplayConfig("u", "m", mode="poisson", rate=0).check()
    with pytest.raises(ValueError, match="mode"):
        ReplayConfig("u", "m", mode="nope").check()  # type: ignore[arg-type]
    assert "api_key" not in ReplayConfig("u", "m", api_key="secret").to_json()


def test_request_body_forces_the_output_length():
    body = request_body(ReplayConfig("u", "m"), [5, 6], 7)
    assert body["max_tokens"] == body["min_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert request_body(ReplayConfig("u", "m"), "x", 0)["max_tokens"] == 1


def test_token_prompts_have_exact_lengths_and_shared_prefixes():
    prompts = TokenPrompts(vocab_size=32000, seed=0)
    a = prompts.prompt(0, TraceRecord(0, 1200, 4, hash_ids=[7, 8, 9]))
    b = prompts.prompt(1, TraceRecord(0, 700, 4, hash_ids=[7, 8]))
    c = prompts.prompt(2, TraceRecord(0, 700, 4, hash_ids=[7, 5]))
    d = prompts.prompt(3, TraceRecord(0, 700, 4, hash_ids=[]))
    assert [len(p) for p in (a, b, c, d)] == [1200, 700, 700, 700]
    assert all(LOW_ID <= t < 32000 for p in (a, b, c, d) for t in p)
    assert a[:700] == b  # equal hash_ids, equal positions: equal tokens
    assert c[:BLOCK_TOKENS] == a[:BLOCK_TOKENS] and c[BLOCK_TOKENS:] != a[BLOCK_TOKENS:700]
    assert d[:16] != a[:16]
    # Blocks past a record's hash_ids are its own.
    e = prompts.prompt(4, TraceRecord(0, 700, 4, hash_ids=[7]))
    f = prompts.prompt(5, TraceRecord(0, 700, 4, hash_ids=[7]))
    assert e[:BLOCK_TOKENS] == f[:BLOCK_TOKENS] and e[BLOCK_TOKENS:] != f[BLOCK_TOKENS:]
    # Deterministic per seed; another seed changes every block.
    assert TokenPrompts(32000, seed=0).prompt(0, TraceRecord(0, 50, 1, [7])) == a[:50]
    assert TokenPrompts(32000, seed=1).prompt(0, TraceRecord(0, 50, 1, [7]))[:16] != a[:16]
    assert TokenPrompts(32000).prompt(0, TraceRecord(0, 0, 1)) == []


def test_block_size_sets_how_much_a_hash_id_shares():
    prompts = TokenPrompts(32000, seed=0, block_tokens=16)
    a = prompts.prompt(0, TraceRecord(0, 40, 1, hash_ids=[0, 1, 2]))
    b = prompts.prompt(1, TraceRecord(0, 40, 1, hash_ids=[0, 3, 4]))
    assert a[:16] == b[:16] and a[16:32] != b[16:32]
    check_block_size([TraceRecord(0, 40, 1, [0, 1, 2])], 16)
    check_block_size([TraceRecord(0, 40, 1, [0])], 512)
    with pytest.raises(ValueError, match="record 0: 3 hash_ids for 40 tokens"):
        check_block_size([TraceRecord(0, 40, 1, [0, 1, 2])], 512)


def test_prompts_use_each_records_block_size():
    """A record that says block_size 16 shares 16 tokens per hash_id without being told; one
    without a block size shares 512 (Mooncake's)."""
    prompts = TokenPrompts(32000, seed=0)
    a = prompts.prompt(0, TraceRecord(0, 40, 1, [0, 1, 2], block_size=16))
    b = prompts.prompt(1, TraceRecord(0, 40, 1, [0, 3, 4], block_size=16))
    assert a[:16] == b[:16] and a[16:32] != b[16:32]
    c = prompts.prompt(2, TraceRecord(0, 600, 1, [0]))
    d = prompts.prompt(3, TraceRecord(0, 600, 1, [0, 9]))
    assert c[:512] == d[:512] and c[512:] != d[512:]
    check_block_size([TraceRecord(0, 40, 1, [0, 1, 2], block_size=16)])


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model_fetch import fetch_default_model

    return load_tokenizer(fetch_default_model())


def test_text_prompts_have_exact_token_counts(tokenizer):
    prompts = TextPrompts(tokenizer, seed=0)
    for length in (1, 2, 17, 200, 513, 1100):
        text = prompts.prompt(length, TraceRecord(0, length, 4, hash_ids=[1, 2, 3]))
        assert len(tokenizer.encode(text)) == length
    assert prompts.inexact == 0
    a = tokenizer.encode(prompts.prompt(0, TraceRecord(0, 300, 4, hash_ids=[9])))
    b = tokenizer.encode(prompts.prompt(1, TraceRecord(0, 200, 4, hash_ids=[9])))
    assert a[:199] == b[:199]
