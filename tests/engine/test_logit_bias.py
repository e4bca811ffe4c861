"""logit_bias in the sampler (against logits + bias in plain torch), its validation, the seed
mapping the server uses, and the prompt token's rank that prompt_logprobs reports."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidSamplingParamsError
from engine.sampler import RankedLogprobs, Sampler, SamplingRow, prompt_logprobs
from engine.sampling_params import SamplingParams, generator_seed
from engine.structured.bitmask import GrammarMask

VOCAB = 64


def row(bias: dict[int, float] | None, seed: int | None = None, **params: object) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(seed=seed, logit_bias=bias, **params),
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        prompt_token_ids=[0],
        output_token_ids=[],
        stop_token_ids=set(),
    )


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_greedy(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> list[int]:
    """Plain torch: a dense bias row added to the logits, then argmax."""
    dense = torch.zeros_like(logits)
    for i, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            dense[i, token] = value
    return (logits + dense).argmax(dim=-1).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_greedy_with_bias_is_argmax_of_biased_logits(seed: int) -> None:
    logits = logits_for(4, seed)
    top = logits.argmax(dim=-1).tolist()
    biases = [{top[0]: -100.0}, {7: 100.0}, None, {top[3]: -2.5, 11: 4.0, 12: 0.0}]
    out = Sampler()(logits.clone(), [row(b, temperature=0) for b in biases])
    assert out.token_ids == reference_greedy(logits, biases)
    assert out.token_ids[0] != top[0]  # -100 moves the greedy choice off the top token
    assert out.token_ids[0] == logits[0].topk(2).indices[1].item()  # to the runner-up
    assert out.token_ids[1] == 7  # +100 forces a token
    assert out.token_ids[2] == top[2]  # a row without bias is untouched


def test_plus_100_forces_a_sampled_token_and_minus_100_bans_it() -> None:
    logits = logits_for(1, 3)
    forced = [
        Sampler()(logits.clone(), [row({5: 100.0}, seed=s, temperature=1.0)]).token_ids[0]
        for s in range(20)
    ]
    assert forced == [5] * 20
    favourite = logits[0].argmax().item()
    hot = torch.full((1, VOCAB), -1.0)
    hot[0, favourite] = 10.0  # without a bias the favourite wins nearly every draw
    banned = [
        Sampler()(hot.clone(), [row({favourite: -100.0}, seed=s, temperature=1.0)]).token_ids[0]
        for s in range(20)
    ]
    assert favourite not in banned


def test_bias_cannot_leave_the_grammar() -> None:
    logits = logits_for(1, 1)
    allowed = [3, 4]
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for token in allowed:
        bitmask[0, token // 32] |= 1 << (token % 32)
    grammar = GrammarMask([0], bitmask)
    out = Sampler()(logits.clone(), [row({9: 100.0, 3: -100.0}, temperature=0)], grammar)
    assert out.token_ids == [4]  # 9 is outside the grammar, 3 is banned: 4 is all that is left


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = logits_for(1, 2)
    out = Sampler()(logits.clone(), [row({5: 100.0}, temperature=0, logprobs=1)])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [5]
    assert math.isclose(out.logprobs[0][5], raw[5].item(), rel_tol=1e-5)


def test_ids_past_the_logits_are_dropped() -> None:
    logits = logits_for(1, 4)
    out = Sampler()(logits.clone(), [row({VOCAB + 10: 100.0, 2: 100.0}, temperature=0)])
    assert out.token_ids == [2]


@pytest.mark.parametrize(
    "bias",
    [{1: 100.5}, {1: -101}, {1: float("nan")}, {1: float("inf")}, {-1: 1.0}, {1: True}, [1]],
)
def test_bad_bias_is_refused_by_name(bias: object) -> None:
    with pytest.raises(InvalidSamplingParamsError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"


def test_any_int64_seed_maps_into_the_engine_range() -> None:
    for seed in (-(2**63), -1, 0, 7, 2**63 - 1):
        mapped = generator_seed(seed)
        assert mapped == generator_seed(seed)
        SamplingParams(seed=mapped, n=4).clone_for_sample(3)  # valid, with room for the index
    assert generator_seed(7) == 7  # seeds already in range keep their meaning


def test_prompt_logprobs_rank_counts_the_more_likely_tokens() -> None:
    logits = logits_for(6, 5)
    targets = [0, 1, 2, 3, logits[4].argmax().item(), 5]
    entries = prompt_logprobs(logits, targets, k=3)
    reference = torch.log_softmax(logits, dim=-1)
    for i, (entry, target) in enumerate(zip(entries, targets, strict=True)):
        assert isinstance(entry, RankedLogprobs) and next(iter(entry)) == target
        assert entry.rank == 1 + int((reference[i] > reference[i, target]).sum())
    assert entries[4].rank == 1
