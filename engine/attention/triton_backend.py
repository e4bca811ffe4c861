"""Paged attention with the Triton kernels of engine.kernels: the GPU path, with the same
interface as TorchAttentionBackend (it also runs on CPU tensors under TRITON_INTERPRET=1).

A mixed batch takes two launches: the decodes (the first num_decodes requests, one token each)
go to the split-K decode kernel, the prefill chunks after them to the prefill kernel; both write
into slices of one output tensor. What the launches need beyond AttentionMetadata (the chunks'
start offsets as a device tensor, the grid sizes) is built on the first layer of a step and kept
in meta.cache for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels.kv_write import write_kv_cache
from engine.kernels.paged_attention import DEFAULT_PARTITION_SIZE, paged_decode, paged_prefill


@dataclass(slots=True)
class _LaunchInputs:
    max_decode_len: int  # longest decode context (sizes the decode grid)
    prefill_start: int  # first token row of the prefill chunks
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1] int32, from 0
    max_q_len: int  # longest prefill chunk


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, partition_size: int = DEFAULT_PARTITION_SIZE):
        self.partition_size = partition_size  # split-K partition of the decode kernel

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store this step's K/V ([T, Hkv, D]) into the pool ([blocks, block_size, Hkv, D]),
        quantized when kv_scales are given."""
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> attention output [T, Hq, D] (written into out when given), reading
        K/V from the pool only (fp8/int8 codes dequantized with kv_scales in the kernels)."""
        if out is None:
            out = torch.empty_like(q)
        inputs = _launch_inputs(meta, q.device)
        nd = meta.num_decodes
        if nd:
            paged_decode(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                max_seq_len=inputs.max_decode_len,
                partition_size=self.partition_size,
                out=out[:nd],
                kv_scales=kv_scales,
            )
        if inputs.prefill_query_start_loc is not None:
            start = inputs.prefill_start
            paged_prefill(
                q[start:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.seq_lens[nd:],
                inputs.prefill_query_start_loc,
                scale,
                max_q_len=inputs.max_q_len,
                out=out[start:],
                kv_scales=kv_scales,
            )
        return out


def _launch_inputs(meta: AttentionMetadata, device: torch.device) -> _LaunchInputs:
    """Built on the step's first layer, reused by the others."""
    if "triton" not in meta.cache:
        nd = meta.num_decodes
        qsl = meta.query_start_loc
        start = qsl[nd]
        prefill_qsl = None
        if nd < meta.num_reqs:
            offsets = [x - start for x in qsl[nd:]]
            prefill_qsl = torch.tensor(offsets, dtype=torch.int32, device=device)
        meta.cache["triton"] = _LaunchInputs(
            max_decode_len=max(meta.seq_lens_list[:nd], default=0),
            prefill_start=start,
            prefill_query_start_loc=prefill_qsl,
            max_q_len=max((b - a for a, b in zip(qsl[nd:-1], qsl[nd + 1 :])), default=0),
        )
    return meta.cache["triton"]
