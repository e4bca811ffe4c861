"""Triton paged attention against the torch reference backend.

On the CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by conftest),
about a second a launch, so batches are a handful of requests of at most ~100 tokens. Every case
is a ragged batch built the way the runner builds it: decodes first, sorted by context, then
prefill chunks whose earlier context is already in the pool; block tables hold shuffled,
non-contiguous block ids; contexts are not multiples of the block size. The Triton side gets a
pool whose every slot outside the requests' contexts is NaN (the reference gets a clean one, since
it multiplies masked padding by zero) and a NaN-filled output, so a read past a context or an
unwritten output element fails. A split-K partition of 32 tokens makes the partition-and-reduce
path run at these small contexts.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kernels.paged_attention import paged_decode, paged_prefill

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def build_meta(
    requests: list[tuple[int, int]], block_size: int, spare_blocks: int, gen: torch.Generator
) -> tuple[AttentionMetadata, int]:
    """AttentionMetadata for requests given as (cached_len, q_len), ordered and laid out as
    ModelRunner._prepare does, over a pool of shuffled block ids; returns it and the pool's
    block count (the blocks the requests need plus spare_blocks that nobody owns)."""
    # The runner's order: decodes (one new token) first, then prefills, each by cached length.
    requests = sorted(requests, key=lambda r: (r[1] != 1, r[0]))
    needed = [-(-(cached + q_len) // block_size) for cached, q_len in requests]
    num_blocks = sum(needed) + spare_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for (cached, q_len), n in zip(requests, needed):
        table = [free.pop() for _ in range(n)]
        end = cached + q_len
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, end)]
        query_start_loc.append(query_start_loc[-1] + q_len)
        seq_lens.append(end)
        tables.append(table)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    meta = AttentionMetadata(
        num_decodes=sum(1 for _, q_len in requests if q_len == 1),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
        query_start_loc=query_start_loc,
        seq_lens_list=seq_lens,
        block_size=block_size,
    )
    return meta, num_blocks


def context_slots(meta: AttentionMetadata, upto: str) -> torch.Tensor:
    """Flat pool slots of every request's cached context ("cached") or full context ("all")."""
    bs, out = meta.block_size, []
    for r, seq_len in enumerate(meta.seq_lens_list):
        q_len = meta.query_start_loc[r + 1] - meta.query_start_loc[r]
        end = seq_len - q_len if upto == "cached" else seq_len
        table = meta.block_tables[r].tolist()
        out += [table[p // bs] * bs + p % bs for p in range(end)]
    return torch.tensor(out, dtype=torch.int64, device=DEVICE)


def poisoned(pool: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A copy of pool that is NaN everywhere but at the flat slots keep."""
    flat = pool.view(-1, *pool.shape[2:])
    out = torch.full_like(flat, math.nan)
    out[keep] = flat[keep]
    return out.view_as(pool)


def model_like_qkv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] as strided views of one tensor, as the model passes them."""
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, device=DEVICE).to(dtype)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    return q, k, v


# (requests as (cached_len, q_len), Hq, Hkv, head_dim, block_size, dtype, partition_size)
BACKEND_CASES = {
    # Mixed: three decodes (two longer than a partition) and three chunks: a fresh prompt, a
    # chunk after a cached prefix, a one-block chunk after a long prefix.
    "mixed-mha-fp32-split": (
        [(37, 1), (80, 1), (5, 1), (0, 23), (40, 17), (61, 9)],
        2, 2, 64, 16, torch.float32, 32,
    ),
    "mixed-gqa3-fp16": (
        [(70, 1), (12, 1), (0, 45), (33, 30)],
        6, 2, 64, 32, torch.float16, 512,
    ),
    "mixed-gqa8-d128-fp32-split": (
        [(95, 1), (3, 1), (50, 1), (20, 28)],
        8, 1, 128, 16, torch.float32, 32,
    ),
    "prefill-only-gqa3-fp16-bs16": (
        [(0, 40), (17, 19), (64, 2)],
        3, 1, 64, 16, torch.float16, 32,
    ),
    # Speculative verification: three requests with 5-token chunks (the last token and four
    # drafts) that the torch backend attends as one batch, next to a decode and two prompts.
    "verify-gqa3-fp32-split": (
        [(30, 5), (47, 5), (52, 5), (20, 1), (9, 3), (0, 20)],
        6, 2, 64, 16, torch.float32, 32,
    ),
    "decode-only-gqa8-fp16-split": (
        [(33, 1), (99, 1), (1, 1), (64, 1)],
        16, 2, 64, 32, torch.float16, 32,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BACKEND_CASES))
def test_backend_matches_torch(case: str) -> None:
    requests, num_heads, num_kv_heads, head_dim, bs, dtype, partition = BACKEND_CASES[case]
    seed = list(BACKEND_CASES).index(case)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    meta, num_blocks = build_meta(requests, bs, spare_blocks=3, gen=gen)
    num_tokens = meta.query_start_loc[-1]
    q, k, v = model_like_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    shape = (num_blocks, bs, num_kv_heads, head_dim)
    k_pool = torch.randn(shape, device=DEVICE).to(dtype)
    v_pool = torch.randn(shape, device=DEVICE).to(dtype)
    scale = head_dim**-0.5

    ref = TorchAttentionBackend()
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    ref.write_kv(k, v, k_ref, v_ref, meta)
    expected = ref.forward(q, k_ref, v_ref, AttentionMetadata(**_fields(meta)), scale)

    # Only the cached context survives the poisoning; write_kv must fill in the step's tokens.
    cached = context_slots(meta, "cached")
    k_tri, v_tri = poisoned(k_pool, cached), poisoned(v_pool, cached)
    tri = TritonAttentionBackend(partition_size=partition)
    tri.write_kv(k, v, k_tri, v_tri, meta)
    out = torch.full_like(q, math.nan)
    result = tri.forward(q, k_tri, v_tri, meta, scale, out=out)

    assert result is out
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # Every slot of every context was written, and nothing outside them.
    full = context_slots(meta, "all")
    flat = k_tri.view(-1, num_kv_heads, head_dim)
    assert not flat[full].isnan().any()
    assert flat.isnan().flatten(1).all(1).sum() == flat.shape[0] - full.numel()


def _fields(meta: AttentionMetadata) -> dict:
    """A fresh copy of meta's inputs (an empty cache), so neither backend sees the other's."""
    names = ("num_decodes", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    return {n: getattr(meta, n) for n in names} | {
        "seq_lens_list": meta.seq_lens_list,
        "block_size": meta.block_size,
    }


def _pools(
    meta: AttentionMetadata, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clean K, clean V, poisoned K, poisoned V) pools with every context filled."""
    shape = (num_blocks, meta.block_size, num_kv_heads, head_dim)
    k_pool = torch.randn(shape, device=DEVICE).to(dtype)
    v_pool = torch.randn(shape, device=DEVICE).to(dtype)
    full = context_slots(meta, "all")
    return k_pool, v_pool, poisoned(k_pool, full), poisoned(v_pool, full)


@pytest.mark.parametrize("block_n", [16, 32])
def test_decode_split_several_tiles_per_partition(block_n: int) -> None:
    """Partitions of 64 keys walked in 4 or 2 tiles each; one context ends exactly on a
    partition boundary, one a key past it."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    meta, num_blocks = build_meta([(127, 1), (40, 1), (192, 1)], 16, spare_blocks=2, gen=gen)
    q = torch.randn(3, 4, 64, device=DEVICE)
    k_pool, v_pool, k_tri, v_tri = _pools(meta, num_blocks, 2, 64, torch.float32)
    expected = TorchAttentionBackend().forward(q, k_pool, v_pool, meta, 0.125)
    out = torch.full_like(q, math.nan)
    paged_decode(
        q, k_tri, v_tri, meta.block_tables, meta.seq_lens, 0.125,
        partition_size=64, out=out, block_n=block_n,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_rows_padded_when_group_does_not_divide_tile() -> None:
    """GQA 3 in a 16-row tile: 5 tokens x 3 heads per tile and one padding row; 16-key tiles
    so the causal boundary falls inside tiles of both the cached prefix and the chunk."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    meta, num_blocks = build_meta([(21, 13), (0, 7), (5, 26)], 16, spare_blocks=1, gen=gen)
    num_tokens = meta.query_start_loc[-1]
    q = torch.randn(num_tokens, 6, 64, device=DEVICE)
    k_pool, v_pool, k_tri, v_tri = _pools(meta, num_blocks, 2, 64, torch.float32)
    expected = TorchAttentionBackend().forward(q, k_pool, v_pool, meta, 0.125)
    qsl = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, math.nan)
    paged_prefill(
        q, k_tri, v_tri, meta.block_tables, meta.seq_lens, qsl, 0.125,
        out=out, block_m=16, block_n=16,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not CUDA, reason="bf16 needs a GPU (the interpreter computes bf16 wrongly)")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backend_bf16_on_gpu(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    torch.manual_seed(head_dim)
    requests = [(700, 1), (40, 1), (1500, 1), (0, 300), (900, 77), (31, 2)]
    meta, num_blocks = build_meta(requests, 16, spare_blocks=4, gen=gen)
    q, _, _ = model_like_qkv(meta.query_start_loc[-1], 32, 8, head_dim, torch.bfloat16)
    k_pool, v_pool, k_tri, v_tri = _pools(meta, num_blocks, 8, head_dim, torch.bfloat16)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().forward(q, k_pool, v_pool, meta, scale)
    out = torch.full_like(q, math.nan)
    fresh = AttentionMetadata(**_fields(meta))
    TritonAttentionBackend().forward(q, k_tri, v_tri, fresh, scale, out=out)
    torch.testing.assert_close(out, expected, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
