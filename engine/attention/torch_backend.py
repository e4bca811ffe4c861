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
        for start, end, blocks, mask in self._decode_buckets(meta):
            out[start:end] = self._decode(q[start:end], k_cache, v_cache, blocks, mask, scale)
        for r in range(meta.num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            out[start:end] = self._prefill(q[start:end], k_cache, v_cache, meta, r, scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        # [n, L, Hkv, D] -> [n, Hkv, L, D]; the G query heads of a KV group form the query "length"
        # axis, so GQA needs no K/V expansion. index_select copies whole blocks (block_size * Hkv *
        # D contiguous elements each): several times faster than advanced indexing here.
        keys = k_cache.index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        qg = q.view(n, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(n, num_heads, head_dim)

    @staticmethod
    def _decode_buckets(
        meta: AttentionMetadata,
    ) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """The decodes split into runs of similar context length, each with the block ids to
        gather and its padding mask; built once per step. Decodes arrive sorted by context length
        (the runner orders them so), and each run is padded only to its own longest context:
        padding all of them to the batch's longest would gather and attend over ~1.5x the keys
        for prompts of mixed lengths."""
        if "decode" not in meta.cache:
            meta.cache["decode"] = [
                _decode_bucket(meta, start, end)
                for start, end in _length_runs(meta.seq_lens_list[: meta.num_decodes])
            ]
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


# A run of decodes closes once the next context is this much longer than the run's shortest, and
# the run has at least _MIN_RUN members (each run costs one more gather and attention call).
_RUN_GROWTH = 1.3
_MIN_RUN = 4


def _length_runs(seq_lens: list[int]) -> list[tuple[int, int]]:
    runs, start = [], 0
    for i in range(1, len(seq_lens) + 1):
        if i == len(seq_lens) or (
            seq_lens[i] > _RUN_GROWTH * seq_lens[start] and i - start >= _MIN_RUN
        ):
            runs.append((start, i))
            start = i
    return runs


def _decode_bucket(
    meta: AttentionMetadata, start: int, end: int
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    num_blocks = -(-max(meta.seq_lens_list[start:end]) // meta.block_size)
    blocks = meta.block_tables[start:end, :num_blocks].reshape(-1)
    positions = torch.arange(num_blocks * meta.block_size, device=blocks.device)
    mask = (positions[None, :] < meta.seq_lens[start:end, None]).view(end - start, 1, 1, -1)
    return start, end, blocks, mask
