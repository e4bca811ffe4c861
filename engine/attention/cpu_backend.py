"""The CPU's attention: the torch backend, with decode batches (one query token per request,
float32 K/V) attended by the fused kernel in engine/kernels/cpu_ops.c, which reads the block
pool through the block tables instead of gathering whole blocks and calling
scaled_dot_product_attention (at one decode token a step that call and the gathers around it
cost more than the arithmetic). Everything else, prompts, speculative verification, fp8/int8
pools, is the torch backend's."""

from __future__ import annotations

import torch

from engine.attention.torch_backend import TorchAttentionBackend, _Bucket, _Pools
from engine.kernels import cpu_ops


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._kernel = cpu_ops.kernel()

    def _batched(
        self, q: torch.Tensor, pools: _Pools, bucket: _Bucket, scale: float
    ) -> torch.Tensor:
        if (
            self._kernel is None
            or bucket.q_len != 1
            or pools.scales is not None
            or q.dtype != torch.float32
            or pools.k.dtype != torch.float32
            or not (pools.k.is_contiguous() and pools.v.is_contiguous())
        ):
            return super()._batched(q, pools, bucket, scale)
        return self._kernel.paged_decode(
            q, pools.k, pools.v, bucket.block_tables, bucket.seq_lens, scale
        )
