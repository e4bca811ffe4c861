"""Rotary position embedding, in place on the q|k heads of a step, neox / rotate-half layout.

Layout: qk is [T, H, D] (H = query heads + kv heads, rotated together as in
engine.models.llama) with unit stride along D; the token and head strides are free, so the
view of the fused qkv projection's output is rotated where it lies, with no copy. cos_sin is
engine.models.rotary.cos_sin_cache's float32 table [max_positions, 2, D]: row 0 holds
(cos, cos) and row 1 (-sin, sin) over the two halves of D. Default and llama3 scaling differ
only in that table, so one kernel serves both.

Grid: (T, cdiv(H, BLOCK_H)). A program looks up its token's position, loads that table row
once and rotates up to BLOCK_H heads with it; each head is loaded as its two halves, so
roll(x) is the other half and the result x * cos + roll(x) * sin needs no gather. A program
reads its whole tile before writing it back, which makes the in-place update safe. Half sizes
that are not powers of two (head_dim 80, 96) use a power-of-two block with a mask.

Numerics follow engine.models.rotary.apply_rotary with cos/sin cast to the activation dtype,
as the model does: both the table entries and the two products are rounded to qk's dtype,
so half precision rounds where the unfused torch code (and HF) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_H = 16


@triton.jit
def _rotary_kernel(
    qk_ptr,
    pos_ptr,
    cs_ptr,
    stride_t,
    stride_h,
    cs_stride_p,
    cs_stride_row,
    num_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    # The grid has exactly T programs along axis 0, so this scalar load is in bounds.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype = qk_ptr.dtype.element_ty
    row = cs_ptr + pos * cs_stride_p
    cos1 = tl.load(row + dims, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(row + half + dims, mask=dim_mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(row + cs_stride_row + dims, mask=dim_mask, other=0.0)
    sin2 = tl.load(row + cs_stride_row + half + dims, mask=dim_mask, other=0.0)
    sin1 = sin1.to(dtype).to(tl.float32)
    sin2 = sin2.to(dtype).to(tl.float32)

    offs = t * stride_t + heads[:, None].to(tl.int64) * stride_h + dims[None, :]
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    x1 = tl.load(qk_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(qk_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    # Each product is rounded to qk's dtype before the sum, as in the unfused torch code.
    out1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32)
    out1 += (x2 * sin1[None, :]).to(dtype).to(tl.float32)
    out2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32)
    out2 += (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    tl.store(qk_ptr + offs, out1.to(dtype), mask=mask)
    tl.store(qk_ptr + offs + half, out2.to(dtype), mask=mask)


def apply_rotary_inplace(
    qk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    """Rotate qk [T, H, D] in place by positions [T] (unsorted is fine; each must be below
    cos_sin.shape[0], which is not checked, to avoid a device sync); returns qk."""
    if qk.dim() != 3 or qk.stride(-1) != 1:
        raise ValueError(f"qk must be [T, H, D] with unit stride along D, got {tuple(qk.shape)}")
    num_tokens, num_heads, head_dim = qk.shape
    if head_dim % 2 or cos_sin.dim() != 3 or cos_sin.shape[1:] != (2, head_dim):
        raise ValueError(
            f"cos_sin {tuple(cos_sin.shape)} does not match head_dim {head_dim} "
            "(expected [max_positions, 2, head_dim], head_dim even)"
        )
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} do not match {num_tokens} tokens")
    if num_tokens == 0 or num_heads == 0:
        return qk
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    block_h = min(triton.next_power_of_2(num_heads), _MAX_BLOCK_H)
    half = head_dim // 2
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        qk,
        positions.contiguous(),
        cos_sin,
        qk.stride(0),
        qk.stride(1),
        cos_sin.stride(0),
        cos_sin.stride(1),
        num_heads,
        half,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return qk
