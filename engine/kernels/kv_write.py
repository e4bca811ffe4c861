"""Store a step's K/V into the paged block pool by slot mapping (vLLM's reshape_and_cache).

Grid: one program per token. Token t's K and V rows ([Hkv, D] each, loaded as one
[next_pow2(Hkv), next_pow2(D)] masked tile) go to slot s = slot_mapping[t] of the pools
[num_blocks, block_size, Hkv, D]: block s // block_size, offset s % block_size. A slot of -1
marks a padding token and is skipped, as in vLLM. Inputs may be strided views (the model's k is a
slice of the fused q/k tensor); only head_dim must be contiguous. Values are cast to the pool's
dtype on store (through fp32, which holds fp16/bf16 exactly), so the copy is exact when the
dtypes agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    # fp32 holds fp16/bf16 exactly; the interpreter needs it to convert bf16 correctly.
    k_offs = t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :]
    k = tl.load(k_ptr + k_offs, mask=mask, other=0.0).to(tl.float32)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
    tl.store(
        kc + offs_h[:, None] * stride_kc_h + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    v_offs = t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    v = tl.load(v_ptr + v_offs, mask=mask, other=0.0).to(tl.float32)
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
    tl.store(
        vc + offs_h[:, None] * stride_vc_h + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (int, on the pools' device; -1 skips a token)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: k {tuple(k.shape)} v {tuple(v.shape)}")
    if k_cache.shape[2:] != k.shape[1:] or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"k {tuple(k.shape)} / slots {tuple(slot_mapping.shape)} do not fit the pool "
            f"{tuple(k_cache.shape)}"
        )
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV pools need a contiguous head_dim")
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip
