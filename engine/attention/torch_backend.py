"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested
against. Correct for any mix of decodes, prefill chunks and prompts whose prefix is cached."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's K/V ([T, Hkv, D]) into the pool ([blocks, block_size, Hkv, D])."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> attention output [T, Hq, D], reading K/V from the pool only."""
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(
                q[: meta.num_decodes], k_cache, v_cache, meta, scale
            )
        for r in range(meta.num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            out[start:end] = self._prefill(q[start:end], k_cache, v_cache, meta, r, scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        blocks, mask = self._decode_inputs(meta)
        # [n, L, Hkv, D] -> [n, Hkv, L, D]; the G query heads of a KV group form the query "length"
        # axis, so GQA needs no K/V expansion. index_select copies whole blocks (block_size * Hkv *
        # D contiguous elements each): several times faster than advanced indexing here.
        keys = k_cache.index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        qg = q.view(n, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(n, num_heads, head_dim)

    @staticmethod
    def _decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids to gather and the padding mask of the decodes; built once per step."""
        if "decode" not in meta.cache:
            n = meta.num_decodes
            num_blocks = -(-max(meta.seq_lens_list[:n]) // meta.block_size)
            blocks = meta.block_tables[:n, :num_blocks].reshape(-1)
            positions = torch.arange(num_blocks * meta.block_size, device=blocks.device)
            mask = (positions[None, :] < meta.seq_lens[:n, None]).view(n, 1, 1, -1)
            meta.cache["decode"] = (blocks, mask)
        return meta.cache["decode"]

    @staticmethod
    def _prefill_inputs(
        meta: AttentionMetadata, r: int, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's blocks and causal mask (built once per step)."""
        key = ("prefill", r)
        if key not in meta.cache:
            seq_len = meta.seq_lens_list[r]
            blocks = meta.block_tables[r, : -(-seq_len // meta.block_size)]
            # Query t sits at position seq_len - q_len + t and sees keys up to and including itself.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=blocks.device)
            keys = torch.arange(seq_len, device=blocks.device)
            meta.cache[key] = (blocks, (keys[None, :] <= q_pos[:, None])[None, None])
        return meta.cache[key]

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        r: int,
        scale: float,
    ) -> torch.Tensor:
        q_len = q.shape[0]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        seq_len = meta.seq_lens_list[r]
        blocks, mask = self._prefill_inputs(meta, r, q_len)
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        # 4-D inputs: torch's CPU flash kernel takes them (3-D ones fall back to the unfused math
        # path, 3x slower here); enable_gqa lets each KV head serve its group of query heads.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
