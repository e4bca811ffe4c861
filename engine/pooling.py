"""Pooling requests (embeddings): a prompt's final hidden states, after the model's final norm,
pooled into one vector. They are prefill-only requests (max_tokens=0) on the generation path:
same scheduler, chunked prefill and batching, and nothing is sampled.

Pooling types follow vLLM's names: "last" (the last prompt token; vLLM's default for decoder
language models, whose last position is the only one that has seen the whole prompt) and "mean"
(all prompt positions). With `dimensions` the vector is cut to its first d values before it is
normalized (OpenAI's Matryoshka shortening: the cut vector has unit length again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequestError

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    pooling_type: PoolingType = "last"
    normalize: bool = True  # L2-normalize the pooled vector (vLLM's and OpenAI's default)
    dimensions: int | None = None  # keep the first d values (checked against the model's width)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}",
                "pooling_type",
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(
                f"normalize must be true or false, got {self.normalize!r}", "normalize"
            )
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise InvalidRequestError(
                f"dimensions must be an integer >= 1, got {d!r}", "dimensions"
            )

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position's hidden state is pooled: then a prefix-cache hit, whose
        positions are never computed, would leave them out ("last" needs only the last position,
        which is always computed: a hit stops one token short of the prompt)."""
        return self.pooling_type == "mean"


@dataclass(slots=True)
class PoolingState:
    """A request's pooling in progress, fed chunk by chunk as its prompt is computed."""

    params: PoolingParams
    num_prompt_tokens: int
    total: torch.Tensor | None = None  # float32 [hidden]: the last row, or the sum of rows
    count: int = 0  # positions pooled so far
    embedding: list[float] | None = field(default=None)  # set once the whole prompt is pooled

    def add(self, first: int, rows: torch.Tensor) -> None:
        """Hidden states [n, hidden] of prompt positions first .. first + n - 1."""
        if first == 0:  # a fresh start: the first chunk, or a recompute after preemption
            self.total, self.count = None, 0
        rows = rows.float()
        if self.params.pooling_type == "last":
            self.total, self.count = rows[-1].clone(), 1
        else:
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
            self.count += rows.shape[0]
        if first + rows.shape[0] == self.num_prompt_tokens:
            self.embedding = self._finish()

    def _finish(self) -> list[float]:
        assert self.total is not None
        vector = self.total if self.params.pooling_type == "last" else self.total / self.count
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        if self.params.normalize:
            vector = F.normalize(vector, p=2, dim=0)
        return vector.cpu().tolist()
