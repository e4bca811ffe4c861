"""SwiGLU activation: silu(gate) * up from the fused gate|up projection, in one pass.

Layout: gate_up is [T, 2I] with gate in the first I columns and up in the last I (the order of
engine.models.llama's fused gate_up weight), unit stride along columns; the output is a fresh
contiguous [T, I] (or the caller's out). Fusing saves the unfused code's intermediate silu(gate)
tensor: one read of gate_up and one write of the output.

Grid: (T, cdiv(I, BLOCK)) with BLOCK = min(next_power_of_2(I), 1024) and a mask for the last
block, so any intermediate size works and a program's tile stays a few registers per thread.

Numerics follow F.silu(gate).mul_(up): silu in float32, rounded to the input dtype, then the
product rounded again, so half precision rounds where the torch code does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, gu_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I] in gate_up's dtype,
    written into out (contiguous [T, I]) when given, else into a fresh tensor."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (num_tokens, inter) or out.dtype != gate_up.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({num_tokens}, {inter}) {gate_up.dtype} tensor")
    if num_tokens == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), _MAX_BLOCK)
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out
