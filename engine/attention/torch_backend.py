"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested
against. Correct for any mix of decodes, prefill chunks and prompts whose prefix is cached.

Requests with a short query (a decode: one token; speculative decoding's verification: the last
token and its drafts) are attended in batches of equal query length and similar context; longer
chunks (prompts) one request at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.kv_quant import copyable, dequantize_kv, quantize_kv
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
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store this step's K/V ([T, Hkv, D]) into the pool ([blocks, block_size, Hkv, D]);
        an fp8/int8 pool gets codes, and kv_scales ([blocks, block_size, Hkv] each) their
        scales (engine/attention/kv_quant.py)."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        slots = meta.slot_mapping
        for x, cache, i in ((k, k_cache, 0), (v, v_cache, 1)):
            if kv_scales is not None:
                x, scale = quantize_kv(x, cache.dtype)
                kv_scales[i].view(-1, num_kv_heads).index_copy_(0, slots, scale)
                x, cache = copyable(x), copyable(cache)
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, x)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> attention output [T, Hq, D], reading K/V from the pool only (an
        fp8/int8 pool's codes dequantized with kv_scales after the gather)."""
        out = torch.empty_like(q)
        pools = _Pools(k_cache, v_cache, kv_scales)
        buckets, long_chunks = self._plan(meta, q.shape[1] // k_cache.shape[2])
        for b in buckets:
            out[b.start : b.end] = self._batched(q[b.start : b.end], pools, b, scale)
        for r in long_chunks:
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            out[start:end] = self._prefill(q[start:end], pools, meta, r, scale)
        return out

    def _batched(
        self,
        q: torch.Tensor,
        pools: _Pools,
        bucket: _Bucket,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = pools.k.shape[2]
        group = num_heads // num_kv_heads
        q_len = bucket.q_len
        n = num_tokens // q_len
        # [n, L, Hkv, D] -> [n, Hkv, L, D]; the q_len x G query rows of a KV group (G query heads
        # per KV head) form the query "length" axis, so GQA needs no K/V expansion. index_select
        # copies whole blocks (block_size * Hkv * D contiguous elements each): several times
        # faster than advanced indexing here.
        keys, values = pools.gather(bucket.blocks, q.dtype)
        keys = keys.view(n, -1, num_kv_heads, head_dim)
        values = values.view(n, -1, num_kv_heads, head_dim)
        qg = (
            q.view(n, q_len, num_kv_heads, group, head_dim)
            .transpose(1, 2)
            .reshape(n, num_kv_heads, q_len * group, head_dim)
        )
        out = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=bucket.mask, scale=scale
        )
        return (
            out.view(n, num_kv_heads, q_len, group, head_dim)
            .transpose(1, 2)
            .reshape(num_tokens, num_heads, head_dim)
        )

    @staticmethod
    def _plan(meta: AttentionMetadata, group: int) -> tuple[list[_Bucket], list[int]]:
        """Buckets of short-query requests, and the long chunks to attend one by one; built once
        per step (every layer reuses it). The runner orders requests by query length, then by
        context, so a bucket is a run of equal query length and similar context, and is padded
        only to its own longest context: padding all of them to the batch's longest would gather
        and attend over ~1.5x the keys for prompts of mixed lengths."""
        if "plan" not in meta.cache:
            qsl = meta.query_start_loc
            q_lens = [qsl[r + 1] - qsl[r] for r in range(meta.num_reqs)]
            buckets: list[_Bucket] = []
            long_chunks: list[int] = []
            r = 0
            while r < meta.num_reqs:
                end = r + 1
                while end < meta.num_reqs and q_lens[end] == q_lens[r]:
                    end += 1
                if q_lens[r] > _MAX_BATCHED_QUERY:
                    long_chunks += range(r, end)
                else:
                    for a, b in _length_runs(meta.seq_lens_list[r:end]):
                        buckets.append(_bucket(meta, r + a, r + b, q_lens[r], group))
                r = end
            meta.cache["plan"] = (buckets, long_chunks)
        return meta.cache["plan"]

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
        pools: _Pools,
        meta: AttentionMetadata,
        r: int,
        scale: float,
    ) -> torch.Tensor:
        q_len = q.shape[0]
        num_kv_heads, head_dim = pools.k.shape[2], pools.k.shape[3]
        seq_len = meta.seq_lens_list[r]
        blocks, mask = self._prefill_inputs(meta, r, q_len)
        keys, values = pools.gather(blocks, q.dtype)
        keys = keys.view(-1, num_kv_heads, head_dim)[:seq_len]
        values = values.view(-1, num_kv_heads, head_dim)[:seq_len]
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


# Chunks up to this many query tokens are attended in batches (a decode, or a decode verifying up
# to 16 proposed tokens); longer ones, prompts, one request at a time.
_MAX_BATCHED_QUERY = 17
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


@dataclass(slots=True)
class _Pools:
    """A layer's K and V pools, with their scales when they hold fp8/int8 codes."""

    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Whole blocks of K and V ([len(blocks), block_size, Hkv, D] each), in dtype. Codes are
        gathered first and dequantized after: the copy moves one byte an element, and only the
        attended blocks are converted."""
        keys, values = self.k.index_select(0, blocks), self.v.index_select(0, blocks)
        if self.scales is None:
            return keys, values
        k_scale, v_scale = (s.index_select(0, blocks) for s in self.scales)
        return dequantize_kv(keys, k_scale, dtype), dequantize_kv(values, v_scale, dtype)


@dataclass(slots=True)
class _Bucket:
    start: int  # first query token
    end: int
    q_len: int  # query tokens per request
    blocks: torch.Tensor  # [n * max_blocks] block ids to gather, request after request
    mask: torch.Tensor  # [n, 1, q_len * G or 1, keys]: which keys each query row sees
    block_tables: torch.Tensor  # [n, max_blocks] the requests' rows of meta.block_tables
    seq_lens: torch.Tensor  # [n]


def _bucket(meta: AttentionMetadata, first: int, last: int, q_len: int, group: int) -> _Bucket:
    """Requests first..last-1, each with q_len query tokens at the end of its context; group:
    query heads per KV head."""
    num_blocks = -(-max(meta.seq_lens_list[first:last]) // meta.block_size)
    blocks = meta.block_tables[first:last, :num_blocks].reshape(-1)
    keys = torch.arange(num_blocks * meta.block_size, device=blocks.device)
    seq_lens = meta.seq_lens[first:last, None]
    if q_len == 1:
        mask = (keys[None, :] < seq_lens).view(last - first, 1, 1, -1)  # broadcast over heads
    else:
        # Query t sits at position seq_len - q_len + t and sees keys up to and including itself;
        # rows are (t, g) for the G query heads of a KV group.
        position = seq_lens - q_len + torch.arange(q_len, device=blocks.device)[None, :]
        mask = keys[None, None, :] <= position[:, :, None]  # [n, q_len, keys]
        mask = mask[:, :, None, :].expand(-1, -1, group, -1)
        mask = mask.reshape(last - first, 1, q_len * group, -1)
    start, end = meta.query_start_loc[first], meta.query_start_loc[last]
    tables, lens = meta.block_tables[first:last], meta.seq_lens[first:last]
    return _Bucket(start, end, q_len, blocks, mask, tables, lens)
