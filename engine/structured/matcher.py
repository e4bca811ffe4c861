"""One request's place in its grammar: an llguidance matcher that has consumed exactly the
request's output tokens so far.

The state belongs to the request, not to its KV blocks: a prefix-cache hit or a preemption by
recompute changes which blocks hold the request's tokens, never which tokens it has produced, and a
recomputed request samples nothing until it has caught up with its outputs, so the matcher never
sees a token twice."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from llguidance import LLMatcher


@dataclass(slots=True)
class RequestMatcher:
    matcher: LLMatcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens (one bit per token id) into row `row` of an int32 CPU
        bitmask. EOS is allowed exactly when the grammar accepts what has been produced."""
        target = bitmask[row]
        if bitmask.dtype != torch.int32 or not target.is_contiguous() or bitmask.is_cuda:
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and an error state) if the grammar forbids it."""
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted tokens (for callers that take tokens back)."""
        if not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.error}")

    @property
    def terminated(self) -> bool:
        """The grammar is complete (or broken): no token but EOS may follow, so the request ends."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        """The matcher broke (an llguidance limit such as too many items, a lexer blow-up): what
        it allowed since is no longer the grammar's language."""
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
