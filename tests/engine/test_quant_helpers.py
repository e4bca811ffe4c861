"""One prefill through a LlamaModel directly (no scheduler): the logits of every position."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.runner import allocate_kv_caches


@torch.inference_mode()
def prefill_logits(model, ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    n = ids.numel()
    blocks = -(-n // block_size)
    meta = AttentionMetadata(
        num_decodes=0,
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(blocks).view(1, blocks),
        seq_lens=torch.tensor([n]),
        query_start_loc=[0, n],
        seq_lens_list=[n],
        block_size=block_size,
    )
    caches = allocate_kv_caches(model, blocks, block_size)
    hidden = model.forward(ids, torch.arange(n), caches, meta)
    return model.compute_logits(hidden)
