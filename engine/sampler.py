"""Turns one step's logits into next tokens, with vLLM v1 semantics.

Order per row: logprobs of the raw logits (before anything below), the structured-output grammar
mask (constrained rows only), logit_bias (before penalties, as in vLLM), repetition penalty,
frequency and presence penalties, min_tokens masking; then greedy rows take the argmax and random
rows go through temperature, min_p, top_k, top_p and a draw from their own generator. Work is
batched over rows; rows that do not use a feature pay nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import GrammarMask, apply_grammar_mask

# Below this temperature a row is sampled greedily, as in vLLM: dividing by it would overflow.
_GREEDY_TEMPERATURE = 1e-5
# How many of a top-p row's largest logits (without top-k) are tried before a full sort of the row,
# tier by tier. SmolLM2's nucleus at T=1, p=0.95 is a median 33 and at most ~800 tokens; on a
# 2-core CPU topk(256) of 64 x 49152 logits costs ~1/10 of sorting them, topk(4096) ~1/4.
_TOP_P_CANDIDATES = (256, 4096)
# prompt_logprobs works on this many positions at a time so its log_softmax copy stays bounded.
_PROMPT_CHUNK = 512

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits matrix: a request that samples a token this step."""

    params: SamplingParams
    # Seeded when params.seed is set, on the logits' device; None: torch's default RNG.
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before this step
    stop_token_ids: frozenset[int] | set[int]  # eos + stop ids, masked while output < min_tokens
    # A verification row sees the drafts before it as generated too. Kept apart, not appended:
    # copying a long output for every row of every step costs more than the step's sampling.
    draft_token_ids: Sequence[int] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + len(self.draft_token_ids)

    def generated(self) -> list[int]:
        """Every token generated before this row's: outputs, then the drafts it sees."""
        if not self.draft_token_ids:
            return self.output_token_ids
        return self.output_token_ids + list(self.draft_token_ids)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # per row: None unless params.logprobs is not None


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], grammar: GrammarMask | None = None
    ) -> SamplerOutput:
        """Sample one token per row. logits: float32 [len(rows), vocab], modified in place;
        grammar: the allowed tokens of the structured-output rows, if any."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput([], [])
        # Logprobs report the model's own distribution, so they are taken before any processing.
        raw_logprobs = raw_logprobs_of(logits, rows)
        process_logits(logits, rows, grammar)
        token_ids = _sample(logits, rows).tolist()
        return SamplerOutput(token_ids, logprobs_dicts(raw_logprobs, token_ids, rows))


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], grammar: GrammarMask | None
) -> None:
    """In place, what every row gets before greedy or random choice: the grammar mask,
    logit_bias, penalties and min_tokens."""
    if grammar is not None:
        apply_grammar_mask(logits, grammar)
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    apply_min_tokens(logits, rows)


def is_greedy(row: SamplingRow) -> bool:
    return row.params.temperature < _GREEDY_TEMPERATURE


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of each prompt position's next token plus its top-k, from the raw logits.

    logits [T, V] are for prompt positions 0..T-1 and next_token_ids[i] is the prompt token at
    position i + 1.
    """
    if logits.dim() != 2 or logits.shape[0] != len(next_token_ids):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match {len(next_token_ids)} next tokens"
        )
    k = min(k, logits.shape[1])
    next_ids = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    entries: list[TokenLogprobs] = []
    for start in range(0, len(next_token_ids), _PROMPT_CHUNK):
        end = start + _PROMPT_CHUNK
        logprobs = torch.log_softmax(logits[start:end].float(), dim=-1)
        actual = logprobs.gather(1, next_ids[start:end].unsqueeze(1))
        # vLLM's rank: 1 + how many tokens are strictly more likely than the prompt token.
        ranks = ((logprobs > actual).sum(dim=-1) + 1).tolist()
        actual = actual.squeeze(1).tolist()
        chunk = _entries(next_token_ids[start:end], actual, logprobs, [k] * len(actual))
        entries += [RankedLogprobs(e, rank) for e, rank in zip(chunk, ranks, strict=True)]
    return entries


class RankedLogprobs(dict):
    """One prompt position's TokenLogprobs (the prompt token first, then the top k in order),
    plus the prompt token's rank in the whole distribution, which the top k cannot tell when the
    token is not among them. A dict, so everything that reads TokenLogprobs reads it unchanged."""

    __slots__ = ("rank",)

    def __init__(self, entry: TokenLogprobs, rank: int) -> None:
        super().__init__(entry)
        self.rank = rank


# ----- logit_bias, penalties and min_tokens -------------------------------------------------------


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: repetition penalty over prompt and output tokens, then frequency and presence
    penalties over output tokens. Rows without penalties are not touched."""
    _apply_repetition_penalty(logits, rows)
    _apply_frequency_presence(logits, rows)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: forbid each row's stop tokens while it has fewer than min_tokens outputs."""
    items = [
        (i, row.stop_token_ids)
        for i, row in enumerate(rows)
        if row.stop_token_ids and row.num_output_tokens < row.params.min_tokens
    ]
    if items:
        row_idx, tok_idx = _token_pairs(items, logits)
        logits[row_idx, tok_idx] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: add each row's logit_bias to its tokens' logits. A token the grammar masked stays
    at -inf (-inf + 100 is -inf), so a bias never lets a constrained row leave its grammar."""
    items = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if not items:
        return
    row_idx, tok_idx = _token_pairs([(i, list(bias)) for i, bias in items], logits)
    values = torch.tensor(
        [v for _, bias in items for t, v in bias.items() if t < logits.shape[1]],
        dtype=logits.dtype,
    )
    # Keys of a dict are distinct, so no (row, token) pair repeats and += is exact.
    logits[row_idx, tok_idx] += values.to(logits.device)


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    picked = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not picked:
        return
    items = [(i, rows[i].prompt_token_ids) for i in picked]
    items += [(i, rows[i].generated()) for i in picked]
    row_idx, tok_idx = _token_pairs(items, logits)
    penalty = _per_row(rows, picked, lambda p: p.repetition_penalty, 1.0, logits.device)[row_idx]
    seen = logits[row_idx, tok_idx]
    # A token seen twice is written twice with the same value (computed from the unpenalized
    # logit), so it is penalized once, as in HF's gather/scatter.
    logits[row_idx, tok_idx] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_frequency_presence(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    picked = [
        i
        for i, row in enumerate(rows)
        if row.num_output_tokens
        and (row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0)
    ]
    if not picked:
        return
    row_idx, tok_idx = _token_pairs([(i, rows[i].generated()) for i in picked], logits)
    vocab = logits.shape[1]
    keys, counts = torch.unique(row_idx * vocab + tok_idx, return_counts=True)
    row_idx, tok_idx = keys // vocab, keys % vocab
    device = logits.device
    frequency = _per_row(rows, picked, lambda p: p.frequency_penalty, 0.0, device)[row_idx]
    presence = _per_row(rows, picked, lambda p: p.presence_penalty, 0.0, device)[row_idx]
    logits[row_idx, tok_idx] -= frequency * counts + presence


def _token_pairs(
    items: list[tuple[int, Collection[int]]], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every token of every item: a sparse [rows, vocab] mask, so the
    work is proportional to the tokens seen rather than to the vocabulary. Ids outside the logits'
    vocabulary are dropped (as HF does): the model cannot emit them, so there is nothing to adjust.
    """
    lengths = torch.tensor([len(tokens) for _, tokens in items])
    row_idx = torch.repeat_interleave(torch.tensor([i for i, _ in items]), lengths)
    tok_idx = torch.tensor(list(chain.from_iterable(t for _, t in items)), dtype=torch.long)
    inside = (tok_idx >= 0) & (tok_idx < logits.shape[1])
    if not bool(inside.all()):
        row_idx, tok_idx = row_idx[inside], tok_idx[inside]
    return row_idx.to(logits.device), tok_idx.to(logits.device)


def _per_row(
    rows: Sequence[SamplingRow],
    picked: list[int],
    value: Callable[[SamplingParams], float],
    default: float,
    device: torch.device,
) -> torch.Tensor:
    """A [len(rows)] tensor of value(params) on the picked rows and default elsewhere."""
    out = torch.full((len(rows),), default, dtype=torch.float32)
    out[picked] = torch.tensor([value(rows[i].params) for i in picked], dtype=torch.float32)
    return out.to(device)


# ----- sampling ----------------------------------------------------------------------------------


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, a filtered random draw for the others."""
    greedy = [i for i, row in enumerate(rows) if is_greedy(row)]
    if len(greedy) == len(rows):
        return logits.argmax(dim=-1)  # torch.argmax, as HF greedy decoding: first max on ties
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    rand = [i for i, row in enumerate(rows) if not is_greedy(row)]
    rand_logits = logits if not greedy else logits[rand]
    tokens[rand] = _sample_random(rand_logits, [rows[i] for i in rand])
    return tokens


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p (modifying logits in place), then a draw per row."""
    return draw(random_probs(logits, rows), [row.generator for row in rows])


def random_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each random row draws from: temperature, min_p, top_k and top_p applied
    (to logits, in place), then softmax."""
    device = logits.device
    params = [row.params for row in rows]
    if any(p.temperature != 1.0 for p in params):
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits.div_(temperature.unsqueeze(1))
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        # top_k >= vocab is off; clamped first, since an unbounded int fits no tensor.
        vocab = logits.shape[1]
        top_k = torch.tensor([min(p.top_k, vocab) for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is below min_p times the row's top probability.

    prob < min_p * max_prob  <=>  logit < max_logit + log(min_p), so no softmax is needed; a row
    with min_p = 0 gets a threshold of -inf and keeps everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: keep each row's top_k logits (<= 0 or >= vocab: off), then the smallest set of
    those whose renormalized probability reaches top_p (1.0: off), always keeping the top token.
    Tokens tied with the last kept logit are kept too."""
    vocab = logits.shape[1]
    top_k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    active = ((top_k < vocab) | (top_p < 1.0)).nonzero().squeeze(1)
    if active.numel() == 0:
        return
    threshold = torch.full((logits.shape[0],), _NEG_INF, device=logits.device)
    every_row = active.numel() == logits.shape[0]
    threshold[active] = _keep_thresholds(
        logits if every_row else logits[active], top_k[active], top_p[active]
    )
    logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)


def _keep_thresholds(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The lowest logit each row keeps. Rows whose nucleus outgrows one tier of topk candidates
    move on to the next, and finally to a full sort."""
    vocab = logits.shape[1]
    threshold = torch.empty(logits.shape[0], device=logits.device)
    pending = torch.arange(logits.shape[0], device=logits.device)
    for tier in (*_TOP_P_CANDIDATES, vocab):
        rows = logits if pending.numel() == logits.shape[0] else logits[pending]
        k, p = top_k[pending], top_p[pending]
        count = int(torch.where(k < vocab, k, tier).max())
        found, covered = _thresholds_from_top(rows, k, p, count)
        threshold[pending] = found
        pending = pending[~covered]
        if pending.numel() == 0:
            break
    return threshold


def _thresholds_from_top(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep thresholds computed from each row's `count` largest logits, and whether those were
    enough to decide (top-k rows always are; top-p-only rows when the nucleus ended inside)."""
    vocab = logits.shape[1]
    count = min(count, vocab)
    has_k = top_k < vocab
    top = logits.topk(count, dim=-1).values  # descending
    kth = top.gather(1, (top_k.clamp(max=count) - 1).unsqueeze(1)).squeeze(1)
    kth = torch.where(has_k, kth, _NEG_INF)
    top = top.masked_fill(top < kth.unsqueeze(1), _NEG_INF)
    # top_p is over the top-k renormalized distribution: a top-k row has all its kept tokens in
    # `top`; a row without top-k needs the normalizer of the whole row.
    log_norm = top.logsumexp(dim=-1)
    if not bool(has_k.all()):
        log_norm = torch.where(has_k, log_norm, logits.logsumexp(dim=-1))
    probs = (top - log_norm.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    # A token is kept while the mass ranked above it is still short of top_p. Rows with top_p = 1
    # keep everything: float rounding must not let their cumulative sum "reach" 1 early.
    reach = torch.where(top_p < 1.0, top_p, float("inf")).unsqueeze(1)
    # >= 1, as nothing ranks above the top token, unless top_p is 0.0 (validation forbids it;
    # the clamp keeps the top token regardless).
    kept = (mass_before < reach).sum(dim=-1).clamp(min=1)
    p_threshold = top.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    covered = has_k | (kept < count) | (count == vocab)
    return torch.maximum(kth, p_threshold), covered


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per entry, from that entry's generator (None: torch's default RNG)."""
    uniform = torch.empty(len(generators), device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand(1, device=device, generator=generator)
    return uniform


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by inverse CDF, from one uniform drawn with the row's own generator.

    A seeded row's token therefore depends only on its own probabilities and generator, never on
    the rest of the batch. One uniform per row instead of vLLM's exponential race (vocab draws per
    row) because drawing 49152 exponentials costs about 1 ms per row on CPU.
    """
    uniform = uniforms(generators, probs.device).unsqueeze(1)
    cdf = probs.cumsum(dim=-1)
    # The target lies in (0, total]: 1 - u is in (0, 1], and scaling by the row's own total
    # absorbs rounding in the cdf. The first cdf entry >= a positive target never belongs to a
    # zero-probability token (its cdf equals the previous entry, which would match first).
    target = (1.0 - uniform) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1)


# ----- logprobs ----------------------------------------------------------------------------------


def raw_logprobs_of(
    logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[int], torch.Tensor] | None:
    """(rows that asked, log_softmax of their raw logits), or None when no row asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return None
    picked = logits if len(wanted) == len(rows) else logits[wanted]
    return wanted, torch.log_softmax(picked, dim=-1)  # a new tensor: later in-place edits skip it


def logprobs_dicts(
    raw: tuple[list[int], torch.Tensor] | None,
    token_ids: list[int],
    rows: Sequence[SamplingRow],
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if raw is None:
        return out
    wanted, logprobs = raw
    sampled_ids = [token_ids[i] for i in wanted]
    index = torch.tensor(sampled_ids, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    sampled = logprobs.gather(1, index).squeeze(1).tolist()
    ks = [min(rows[i].params.logprobs, logprobs.shape[1]) for i in wanted]
    for i, entry in zip(wanted, _entries(sampled_ids, sampled, logprobs, ks), strict=True):
        out[i] = entry
    return out


def _entries(
    token_ids: list[int], token_logprobs: list[float], logprobs: torch.Tensor, ks: list[int]
) -> list[TokenLogprobs]:
    """Per row: the given token first, then the row's top ks[row] tokens by logprob."""
    k_max = max(ks, default=0)
    entries = [{t: lp} for t, lp in zip(token_ids, token_logprobs, strict=True)]
    if k_max == 0:
        return entries
    top_values, top_ids = logprobs.topk(k_max, dim=-1)
    for entry, ids, values, k in zip(
        entries, top_ids.tolist(), top_values.tolist(), ks, strict=True
    ):
        entry.update(zip(ids[:k], values[:k], strict=True))
    return entries
