"""Sampler: greedy, penalties, min_tokens, filters, seeded draws and logprobs vs references."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

import engine.sampler as sampler_module
from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    prompt_logprobs,
)
from engine.sampling_params import SamplingParams

FAST = settings(max_examples=40, deadline=None)


def make_row(
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stop: set[int] | None = None,
    **params: object,
) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(
        params=SamplingParams(seed=seed, **params),
        generator=generator,
        prompt_token_ids=list(prompt or [0]),
        output_token_ids=list(output or []),
        stop_token_ids=set(stop or ()),
    )


def random_logits(seed: int, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return Sampler()(logits.clone(), rows).token_ids


# ----- greedy ------------------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 8), vocab=st.integers(1, 64))
def test_greedy_batch_is_torch_argmax(seed: int, rows: int, vocab: int) -> None:
    # Few distinct values, so ties are common: the first maximum must win, as in HF greedy.
    logits = torch.randint(0, 4, (rows, vocab), generator=torch.Generator().manual_seed(seed))
    logits = logits.float()
    tokens = sample(logits, [make_row(temperature=0.0) for _ in range(rows)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_greedy_ties_take_first_index() -> None:
    assert sample(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), [make_row(temperature=0.0)]) == [1]


def test_near_zero_temperature_is_greedy() -> None:
    logits = random_logits(0, 4, 100)
    rows = [make_row(temperature=1e-7, seed=i) for i in range(4)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = random_logits(1, 6, 50)
    rows = [make_row(temperature=0.0) if i % 2 else make_row(temperature=1.0) for i in range(6)]
    tokens = sample(logits, rows)
    assert tokens[1::2] == logits[1::2].argmax(dim=-1).tolist()


def test_empty_batch_and_shape_mismatch() -> None:
    assert Sampler()(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [make_row()])


# ----- penalties ---------------------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 31), min_size=0, max_size=20)


@FAST
@given(
    seed=st.integers(0, 2**31),
    penalty=st.floats(0.3, 3.0),
    prompt=token_lists.filter(bool),
    output=token_lists,
)
def test_repetition_penalty_matches_transformers(
    seed: int, penalty: float, prompt: list[int], output: list[int]
) -> None:
    logits = random_logits(seed, 1, 32)
    logits[0, ::5] = 0.0  # the zero edge case of "> 0 divides, else multiplies"
    expected = RepetitionPenaltyLogitsProcessor(penalty)(
        torch.tensor([prompt + output]), logits.clone()
    )
    row = make_row(prompt=prompt, output=output, repetition_penalty=penalty)
    actual = logits.clone()
    apply_penalties(actual, [row])
    assert torch.equal(actual, expected)
    # A greedy row samples the argmax of the penalized logits.
    row.params.temperature = 0.0
    assert sample(logits, [row]) == expected.argmax(dim=-1).tolist()


def reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The straightforward per-token version: repetition, then frequency and presence."""
    out = logits.clone()
    p = row.params
    for token in set(row.prompt_token_ids) | set(row.output_token_ids):
        value = out[token].item()
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in Counter(row.output_token_ids).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


penalty_rows = st.builds(
    lambda prompt, output, rep, freq, pres: make_row(
        prompt=prompt,
        output=output,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
    ),
    prompt=token_lists.filter(bool),
    output=token_lists,
    rep=st.sampled_from([1.0, 0.8, 1.3]),
    freq=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    pres=st.sampled_from([0.0, 0.7, -2.0]),
)


@FAST
@given(seed=st.integers(0, 2**31), rows=st.lists(penalty_rows, min_size=1, max_size=6))
def test_batched_penalties_match_reference(seed: int, rows: list[SamplingRow]) -> None:
    logits = random_logits(seed, len(rows), 32)
    actual = logits.clone()
    apply_penalties(actual, rows)
    for i, row in enumerate(rows):
        expected = reference_penalties(logits[i], row)
        torch.testing.assert_close(actual[i], expected, rtol=0, atol=1e-5)
        p = row.params
        if (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0):
            assert torch.equal(actual[i], logits[i])  # rows without penalties are not touched


def test_penalties_ignore_ids_outside_vocab() -> None:
    logits = torch.ones(1, 8)
    row = make_row(prompt=[3, 8, 100], output=[3, 9], repetition_penalty=2.0, presence_penalty=1.0)
    apply_penalties(logits, [row])
    assert logits[0].tolist() == [1.0, 1.0, 1.0, -0.5, 1.0, 1.0, 1.0, 1.0]


# ----- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2], logits[0, 5], logits[0, 7] = 9.0, 8.0, 1.0
    stop = {2, 5, 50}  # 50 is outside the vocabulary and ignored

    def row(produced: int, **params: object) -> SamplingRow:
        return make_row(output=[0] * produced, stop=stop, min_tokens=3, **params)

    assert sample(logits.expand(2, -1), [row(0, temperature=0.0), row(2, temperature=0.0)]) == [
        7,
        7,
    ]
    assert sample(logits, [row(3, temperature=0.0)]) == [2]
    # Random rows never draw a masked stop id, whatever the seed.
    draws = sample(logits.expand(200, -1), [row(1, seed=s, temperature=5.0) for s in range(200)])
    assert not {2, 5} & set(draws)


# ----- filters -----------------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**31), temperature=st.floats(0.05, 5.0), rows=st.integers(1, 6))
def test_top_k_1_and_tiny_top_p_equal_greedy(seed: int, temperature: float, rows: int) -> None:
    logits = random_logits(seed, rows, 300)
    greedy = logits.argmax(dim=-1).tolist()
    top_k = [make_row(seed=seed + i, temperature=temperature, top_k=1) for i in range(rows)]
    top_p = [make_row(temperature=temperature, top_p=1e-6) for _ in range(rows)]
    min_p = [make_row(seed=i, temperature=temperature, min_p=1.0) for i in range(rows)]
    assert sample(logits, top_k) == greedy
    assert sample(logits, top_p) == greedy
    assert sample(logits, min_p) == greedy


@FAST
@given(seed=st.integers(0, 2**31), min_p=st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_at_least_min_p_times_top(seed: int, min_p: float) -> None:
    logits = random_logits(seed, 3, 200)
    filtered = logits.clone()
    apply_min_p(filtered, torch.full((3,), min_p))
    probs = logits.double().softmax(dim=-1)
    ratio = probs / probs.amax(dim=-1, keepdim=True)
    decided = (ratio - min_p).abs() > 1e-5  # tokens too close to the cut may fall either way
    kept = filtered > float("-inf")
    assert torch.equal(kept[decided], (ratio >= min_p)[decided])
    assert torch.equal(filtered[kept], logits[kept])


def reference_keep(logits: torch.Tensor, k: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, decided) for one row by full sort, as vLLM does, in float64."""
    vocab = logits.shape[0]
    values, order = logits.double().sort(descending=True)
    if 0 < k < vocab:
        values[k:] = float("-inf")
    probs = values.softmax(dim=0)
    mass_before = probs.cumsum(dim=0) - probs
    keep_sorted = mass_before < p if p < 1.0 else values > float("-inf")
    decided_sorted = (mass_before - p).abs() > 1e-5 if p < 1.0 else torch.ones(vocab, dtype=bool)
    kept = torch.empty(vocab, dtype=torch.bool)
    decided = torch.empty(vocab, dtype=torch.bool)
    kept[order], decided[order] = keep_sorted, decided_sorted
    return kept, decided


@FAST
@given(
    seed=st.integers(0, 2**31),
    params=st.lists(
        st.tuples(st.sampled_from([-1, 0, 1, 3, 20, 63, 64, 100]), st.floats(0.01, 1.0)),
        min_size=1,
        max_size=6,
    ),
    scale=st.sampled_from([0.3, 2.0, 6.0]),
    candidates=st.sampled_from([(2,), (2, 8), (1024,)]),
)
def test_top_k_top_p_match_sort_reference(
    seed: int, params: list[tuple[int, float]], scale: float, candidates: tuple[int, ...]
) -> None:
    # Few topk candidates send rows with a large nucleus through later tiers and the full sort.
    logits = random_logits(seed, len(params), 64, scale)
    filtered = logits.clone()
    top_k = torch.tensor([k for k, _ in params])
    top_p = torch.tensor([p for _, p in params])
    with mock.patch.object(sampler_module, "_TOP_P_CANDIDATES", candidates):
        apply_top_k_top_p(filtered, top_k, top_p)
    for i, (k, _) in enumerate(params):
        kept, decided = reference_keep(logits[i], k, float(top_p[i]))
        actual = filtered[i] > float("-inf")
        assert actual[logits[i].argmax()]  # the top token always survives
        assert torch.equal(actual[decided], kept[decided])
        assert torch.equal(filtered[i][actual], logits[i][actual])


def test_top_k_keeps_ties_and_ignores_out_of_range_k() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0]])
    apply_top_k_top_p(logits, torch.tensor([2, 4, -1]), torch.ones(3))
    inf = float("-inf")
    assert logits.tolist() == [[3.0, 2.0, 2.0, inf], [3.0, 2.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0]]


# ----- random draws ------------------------------------------------------------------------------


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRITICAL = {2: 13.82, 5: 20.52}


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_follows_softmax(seeded: bool) -> None:
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    n = 4000
    rows = [make_row(seed=i if seeded else None, temperature=0.7) for i in range(n)]
    tokens = sample(logits.expand(n, -1), rows)
    assert chi_square(tokens, (logits / 0.7).softmax(dim=0)) < CHI2_CRITICAL[5]


def test_filtered_sampling_follows_renormalized_distribution() -> None:
    torch.manual_seed(99)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    n = 4000
    # top_k=4 keeps {0, 5, 1, 2}; top_p=0.8 of their renormalized mass keeps {0, 5, 1}.
    rows = [make_row(temperature=1.3, top_k=4, top_p=0.8) for _ in range(n)]
    tokens = sample(logits.expand(n, -1), rows)
    expected = torch.zeros(6)
    expected[[0, 5, 1]] = (logits[[0, 5, 1]] / 1.3).softmax(dim=0)
    assert chi_square(tokens, expected) < CHI2_CRITICAL[2]


def test_different_seeds_draw_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    tokens = {sample(logits, [make_row(seed=s)])[0] for s in range(20)}
    assert len(tokens) > 10


other_rows = st.lists(
    st.sampled_from(
        [
            {"temperature": 0.0},
            {"temperature": 1.0},
            {"temperature": 0.5, "top_p": 0.9},
            {"temperature": 1.2, "top_k": 5, "min_p": 0.1, "seed": 5},
            {"temperature": 0.9, "repetition_penalty": 1.2, "logprobs": 3, "seed": 77},
        ]
    ),
    max_size=6,
)


@FAST
@given(others=other_rows, position=st.integers(0, 6), reverse=st.booleans())
def test_seeded_row_ignores_batch_composition(
    others: list[dict], position: int, reverse: bool
) -> None:
    target = {"temperature": 0.8, "top_p": 0.95, "seed": 31337, "output": [1, 2]}
    target_logits = random_logits(7, 1, 500, scale=0.5)  # flat enough that the seed matters

    def run(batch: list[dict]) -> list[int]:
        """The target's tokens over three steps, with fresh generators, in this batch."""
        rows = [make_row(**spec) for spec in batch]
        at = batch.index(target)
        tokens = []
        for step in range(3):
            logits = random_logits(step, len(batch), 500)
            logits[at] = target_logits
            tokens.append(sample(logits, rows)[at])
        return tokens

    batch = list(others)
    batch.insert(min(position, len(batch)), target)
    if reverse:
        batch.reverse()
    torch.manual_seed(0)
    alone = run([target])
    torch.manual_seed(1)  # unseeded rows in the batch see a different default RNG stream
    assert run(batch) == alone


# ----- logprobs ----------------------------------------------------------------------------------


@FAST
@given(
    seed=st.integers(0, 2**31),
    ks=st.lists(st.sampled_from([None, 0, 1, 5]), min_size=1, max_size=8),
)
def test_logprobs_hold_top_k_and_sampled_token_of_raw_logits(
    seed: int, ks: list[int | None]
) -> None:
    logits = random_logits(seed, len(ks), 100)
    # Processing that changes the distribution must not change the reported logprobs.
    rows = [
        make_row(
            seed=seed + i,
            logprobs=k,
            output=[3, 3, 4],
            temperature=[0.0, 0.6, 2.0][i % 3],
            top_k=10,
            repetition_penalty=1.5,
            frequency_penalty=1.0,
        )
        for i, k in enumerate(ks)
    ]
    out = Sampler()(logits.clone(), rows)
    raw = logits.double().log_softmax(dim=-1)
    for i, k in enumerate(ks):
        entry = out.logprobs[i]
        if k is None:
            assert entry is None
            continue
        token = out.token_ids[i]
        expected_ids = set(raw[i].topk(k).indices.tolist()) | {token}
        assert set(entry) == expected_ids
        for token_id, value in entry.items():
            assert abs(value - raw[i, token_id].item()) < 1e-6


def test_prompt_logprobs() -> None:
    logits = random_logits(3, 7, 20)
    next_ids = [4, 4, 19, 0, 7, 7, 1]
    raw = logits.double().log_softmax(dim=-1)
    entries = prompt_logprobs(logits, next_ids, 3)
    assert len(entries) == 7
    for i, entry in enumerate(entries):
        assert set(entry) == set(raw[i].topk(3).indices.tolist()) | {next_ids[i]}
        for token_id, value in entry.items():
            assert abs(value - raw[i, token_id].item()) < 1e-6
    only_actual = prompt_logprobs(logits, next_ids, 0)
    assert [list(e) for e in only_actual] == [[t] for t in next_ids]
    with mock.patch.object(sampler_module, "_PROMPT_CHUNK", 2):  # chunking changes nothing
        assert prompt_logprobs(logits, next_ids, 3) == entries
    with pytest.raises(ValueError):
        prompt_logprobs(logits, next_ids[:-1], 3)
