"""Store a step's K/V into the paged block pool by slot mapping (vLLM's reshape_and_cache).

Grid: one program per token. Token t's K and V rows ([Hkv, D] each, loaded as one
[next_pow2(Hkv), next_pow2(D)] masked tile) go to slot s = slot_mapping[t] of the pools
[num_blocks, block_size, Hkv, D]: block s // block_size, offset s % block_size. A slot of -1
marks a padding token and is skipped, as in vLLM. Inputs may be strided views (the model's k is a
slice of the fused q/k tensor); only head_dim must be contiguous. Values are cast to the pool's
dtype on store (through fp32, which holds fp16/bf16 exactly), so the copy is exact when the
dtypes agree. An fp8/int8 pool (engine/attention/kv_quant.py) gets codes x / s, with one scale
s = absmax(x) / QMAX per (token, KV head) stored at the same slot of its scale pool
[num_blocks, block_size, Hkv]: the same arithmetic as kv_quant.quantize_kv.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.attention.kv_quant import check_scale_pools, qmax_of

# triton.jit picks the interpreter when the kernel is defined, from this variable.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to_e4m3(x):
    """x (|x| <= 448, fp32) rounded to the nearest float8_e4m3fn value, ties to even, as the
    GPU's cast rounds. Only under the interpreter, whose fp32 -> fp8 cast drops the carry of a
    round-up into the exponent (127.9 -> 64, not 128); cast afterwards, the value is exact."""
    mag = tl.abs(x)
    # 3 mantissa bits: the step is 2^(exponent - 3); subnormals share the step of 2^-6's binade.
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(mag, 0.015625))) - 3.0)
    y = mag / step
    f = tl.floor(y)
    d = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))
    return tl.where(x < 0, -r, r) * step


@triton.jit
def _store_row(
    x,
    cache_ptr,
    scale_ptr,
    head_mask,
    mask,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
    FP8_GRID: tl.constexpr,
):
    """Store one token's rows x [BLOCK_H, BLOCK_D] (fp32, zero where masked) at cache_ptr
    [BLOCK_H, BLOCK_D] pointers; quantized, with its per-head scales at scale_ptr [BLOCK_H]."""
    if QUANT:
        scale = tl.max(tl.abs(x), 1) / QMAX
        tl.store(scale_ptr, scale, mask=head_mask)
        # An all-zero row keeps scale 0 (it reads back as zeros) and is divided by 1, not 0.
        x = x / tl.where(scale > 0, scale, 1.0)[:, None]
        x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
        if ROUND:  # int8: half up, as quantize_kv rounds
            x = tl.floor(x + 0.5)
        elif FP8_GRID:
            x = _round_to_e4m3(x)
    tl.store(cache_ptr, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
    FP8_GRID: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < NUM_KV_HEADS
    mask = head_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    # Scale pools are contiguous [num_blocks, block_size, Hkv]: slot s's heads at s * Hkv.
    scale_offs = slot * NUM_KV_HEADS + offs_h

    # fp32 holds fp16/bf16 exactly; the interpreter needs it to convert bf16 correctly.
    k_offs = t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :]
    k = tl.load(k_ptr + k_offs, mask=mask, other=0.0).to(tl.float32)
    kc = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
    _store_row(
        k, kc + offs_h[:, None] * stride_kc_h + offs_d[None, :], k_scale_ptr + scale_offs,
        head_mask, mask, QUANT, QMAX, ROUND, FP8_GRID,
    )  # fmt: skip
    v_offs = t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    v = tl.load(v_ptr + v_offs, mask=mask, other=0.0).to(tl.float32)
    vc = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
    _store_row(
        v, vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], v_scale_ptr + scale_offs,
        head_mask, mask, QUANT, QMAX, ROUND, FP8_GRID,
    )  # fmt: skip


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (int, on the pools' device; -1 skips a token). With kv_scales (contiguous float32
    [num_blocks, block_size, Hkv] each, for K and V) the pools hold fp8/int8 codes."""
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
    quant = check_scale_pools(k_cache, kv_scales)
    k_scale, v_scale = kv_scales if kv_scales is not None else (k_cache, v_cache)  # unused
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], QUANT=quant, QMAX=qmax_of(k_cache.dtype) if quant else 0.0,
        ROUND=k_cache.dtype == torch.int8, FP8_GRID=_INTERPRET and quant,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip
