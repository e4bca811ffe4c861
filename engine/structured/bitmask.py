"""The token bitmask of one step's constrained rows, and its application to the logits.

Bit j of word w in a row allows token 32 * w + j. Only constrained rows get a bitmask row, so a step
with no constrained request does no work here and unconstrained rows are never touched. Masks are
filled in parallel by llguidance's executor (it releases the GIL and uses its own threads).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from llguidance import LLExecutor

from engine.structured.matcher import RequestMatcher

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class GrammarMask:
    rows: list[int]  # indices of the constrained rows in the step's logits
    bitmask: torch.Tensor  # int32 [len(rows), words] on the CPU: a set bit allows the token


def fill_grammar_mask(matchers: Sequence[RequestMatcher | None], words: int) -> GrammarMask | None:
    """The bitmask of the rows that have a matcher (None: no row is constrained)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    if len(rows) == 1:
        matchers[rows[0]].fill_bitmask(bitmask, 0)
    else:
        pairs = [(matchers[row].matcher, k) for k, row in enumerate(rows)]
        _get_executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
    return GrammarMask(rows, bitmask)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """In place: disallowed tokens of the constrained rows get -inf."""
    vocab = logits.shape[1]
    allowed = ((mask.bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:  # the grammar's vocabulary is narrower: the rest is disallowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    if len(mask.rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = torch.tensor(mask.rows, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@functools.cache
def _get_executor() -> LLExecutor:
    return LLExecutor()  # one pool of threads for the process, made on first use
