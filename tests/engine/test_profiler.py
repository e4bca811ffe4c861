"""The step profiler: one JSON line per scheduled step, with StepRecord's fields, whose token counts
add up to the work the requests needed."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.profiler import StepRecord
from tests.engine.tiny_models import build_tiny_model

VOCAB = 384  # tiny_models' vocab_size
FIELDS = {f.name: f.type for f in dataclasses.fields(StepRecord)}


def _prompts(lengths: list[int], seed: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def _params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def _llm(model_dir: Path, path: Path, **kwargs) -> tuple[LLM, list]:
    """An LLM that profiles into `path`, and the list of non-empty schedules it ran."""
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=16,
        enable_prefix_caching=False,
        profile_path=path,
        **kwargs,
    )
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule
    schedules = []

    def recording_schedule():
        out = schedule()
        if out.scheduled:
            schedules.append([(s.request.request_id, s.num_tokens) for s in out.scheduled])
        return out

    scheduler.schedule = recording_schedule
    return llm, schedules


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    assert lines and all(line.strip() for line in lines)
    return [json.loads(line) for line in lines]


def _check_each_record(records: list[dict], max_num_seqs: int, budget: int) -> None:
    for i, rec in enumerate(records):
        assert set(rec) == set(FIELDS), rec
        for name, value in rec.items():
            assert isinstance(value, float if FIELDS[name] == "float" else int), (name, value)
        assert rec["step"] == i
        assert rec["wall_s"] > 0
        assert 1 <= rec["batch_size"] <= max_num_seqs
        assert 1 <= rec["num_batched_tokens"] <= budget
        assert rec["prefill_tokens"] + rec["decode_requests"] == rec["num_batched_tokens"]
        assert rec["decode_requests"] <= rec["batch_size"]
        assert rec["context_tokens"] >= rec["num_batched_tokens"]
        assert rec["num_waiting"] >= 0 and rec["num_preempted"] >= 0
    times = [rec["time"] for rec in records]
    assert times == sorted(times)


def test_profile_accounts_for_every_token(model_dir, tmp_path):
    # Budget 32, no prompt chunk of a single token: every prompt is longer than one token, and the
    # budget left to a prompt chunk is never 1 here (checked below on the real schedule), so
    # prefill_tokens counts prompt tokens exactly and decode_requests the other outputs.
    lengths, max_tokens = [20, 45, 9, 33, 14, 27], [5, 3, 8, 4, 6, 2]
    prompts = _prompts(lengths)
    path = tmp_path / "steps.jsonl"
    llm, schedules = _llm(model_dir, path, max_num_seqs=4, max_num_batched_tokens=32)
    results = llm.generate(prompts, _params(max_tokens))
    outputs = [len(r.outputs[0].token_ids) for r in results]
    assert outputs == max_tokens

    records = _records(path)
    assert len(records) == len(schedules)
    _check_each_record(records, max_num_seqs=4, budget=32)
    num_prompt, num_output, num_requests = sum(lengths), sum(outputs), len(prompts)
    # The last output token is never fed back, so the work is prompts + outputs - requests.
    total = sum(r["num_batched_tokens"] for r in records)
    assert total == num_prompt + num_output - num_requests
    assert [r["batch_size"] for r in records] == [len(s) for s in schedules]
    assert [r["num_batched_tokens"] for r in records] == [sum(n for _, n in s) for s in schedules]
    # The premise of the exact split below: no step ran a 1-token prompt chunk.
    decode_chunks = sum(1 for s in schedules for _, n in s if n == 1)
    assert decode_chunks == num_output - num_requests
    assert sum(r["prefill_tokens"] for r in records) == num_prompt
    assert sum(r["decode_requests"] for r in records) == num_output - num_requests
    assert sum(r["num_preempted"] for r in records) == 0
    assert records[0]["num_waiting"] == num_requests - records[0]["batch_size"]
    assert records[-1]["num_waiting"] == 0
    # Context: each request attends to all its tokens so far, on every step it runs in.
    assert records[0]["context_tokens"] == records[0]["num_batched_tokens"]
    # Attention pairs: the whole causal triangle of every request's tokens but its last output.
    assert sum(r["attention_pairs"] for r in records) == sum(
        (n - 1) * n // 2 for n in (p + o for p, o in zip(lengths, outputs))
    )
    assert sum(r["sampled_requests"] for r in records) == num_output
    assert records[0]["gap_s"] == 0.0 and all(r["gap_s"] >= 0 for r in records)


def test_one_token_prompt_chunk_counts_as_a_decode(model_dir, tmp_path):
    # A 17-token prompt under a 16-token budget: chunks of 16 and 1; the 1-token chunk is
    # reported as a decode request, not as prefill (the profiler counts chunk sizes).
    path = tmp_path / "steps.jsonl"
    llm, schedules = _llm(model_dir, path, max_num_seqs=2, max_num_batched_tokens=16)
    results = llm.generate(_prompts([17]), _params([4]))
    assert len(results[0].outputs[0].token_ids) == 4
    records = _records(path)
    _check_each_record(records, max_num_seqs=2, budget=16)
    assert [r["num_batched_tokens"] for r in records] == [16, 1, 1, 1, 1]
    assert sum(r["prefill_tokens"] for r in records) == 16
    assert sum(r["decode_requests"] for r in records) == 4 - 1 + 1
    assert sum(r["num_batched_tokens"] for r in records) == 17 + 4 - 1


def test_profile_appends_across_calls_and_records_preemptions(model_dir, tmp_path):
    lengths, max_tokens = [40, 45, 30, 50], [16, 16, 16, 16]
    path = tmp_path / "nested" / "steps.jsonl"
    llm, schedules = _llm(model_dir, path, max_num_seqs=4, num_kv_blocks=10)
    llm.generate(_prompts(lengths), _params(max_tokens))
    first = len(_records(path))
    llm.generate(_prompts([12, 21]), _params([3, 3]))
    records = _records(path)
    assert len(records) == len(schedules) > first
    _check_each_record(records, max_num_seqs=4, budget=1024)
    preemptions = llm.engine.core.scheduler.num_preemptions
    assert preemptions > 0
    assert sum(r["num_preempted"] for r in records) == preemptions
    # A preempted request is recomputed: more work than the identity without preemption.
    work = sum(lengths) + sum(max_tokens) - len(lengths) + (12 + 21 + 3 + 3 - 2)
    assert sum(r["num_batched_tokens"] for r in records) > work
