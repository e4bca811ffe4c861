"""What the model asks of an attention backend; two implement it: `torch_backend` (CPU, and the
reference) and `triton_backend` (GPU kernels reading the block pool directly)."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store this step's K/V ([T, Hkv, D]) at meta.slot_mapping in the pool; an fp8/int8
        pool stores codes and kv_scales (K's, V's) their per-(token, KV head) scales
        (engine/attention/kv_quant.py)."""

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> attention output [T, Hq, D], reading K/V from the pool (dequantized
        with kv_scales when given)."""
