"""The per-step description of a flattened batch that every attention backend consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Requests are ordered decodes first (one query token each, by context length), then the
    other chunks by query length (short ones: decodes verifying proposed tokens) and context.

    Token i of the flattened batch belongs to the request r with
    query_start_loc[r] <= i < query_start_loc[r + 1]; its K/V goes to slot slot_mapping[i] of the
    block pool. seq_lens[r] counts the request's context after this step (cached + new tokens).
    """

    num_decodes: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64 (unused entries 0)
    seq_lens: torch.Tensor  # [num_reqs] int64
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens_list: list[int]
    block_size: int
    # Derived tensors a backend builds on first use and every later layer of the step reuses.
    cache: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)
