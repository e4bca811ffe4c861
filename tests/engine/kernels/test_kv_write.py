"""The Triton KV write (reshape_and_cache) against the torch backend's index_copy_.

Slots are scattered over the pool in random order; k is a strided view as the model passes it
(a slice of the fused q/k tensor); padding tokens carry slot -1 and must leave the pool alone.
The pools start as NaN so the comparison also proves nothing else was touched; the copy is exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels.kv_write import write_kv_cache

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots
) -> None:
    """TorchAttentionBackend.write_kv without the padding tokens (index_copy_ rejects -1)."""
    keep = slots >= 0
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], k[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], v[keep])


def _run(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding: int,
) -> None:
    num_blocks = -(-num_tokens // block_size) + 3
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k = qk[:, num_heads:]
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, device=DEVICE)[:num_padding]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, math.nan)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv_cache(k, v, k_cache, v_cache, slots)
    _reference(k, v, k_ref, v_ref, slots)

    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    written = ~k_cache.view(-1, num_kv_heads * head_dim).isnan().all(1)
    assert written.sum() == num_tokens - num_padding


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "block_size", "dtype", "num_padding"),
    [
        (37, 4, 2, 64, 16, torch.float32, 0),
        (53, 6, 3, 128, 32, torch.float16, 5),  # 3 KV heads: a masked head lane
        (20, 8, 1, 64, 16, torch.float32, 3),
    ],
)
def test_write_matches_index_copy(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding: int,
) -> None:
    torch.manual_seed(num_tokens)
    _run(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_padding)


@pytest.mark.skipif(
    not CUDA, reason="bf16 runs on a GPU only (the interpreter computes bf16 wrongly)"
)
def test_write_bf16_on_gpu() -> None:
    torch.manual_seed(0)
    _run(300, 32, 8, 128, 16, torch.bfloat16, 7)


def test_all_padding_and_empty_batches_write_nothing() -> None:
    pool = torch.full((2, 16, 1, 32), math.nan, device=DEVICE)
    k = torch.randn(3, 1, 32, device=DEVICE)
    write_kv_cache(k, k, pool, pool, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    write_kv_cache(k[:0], k[:0], pool, pool, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert pool.isnan().all()
