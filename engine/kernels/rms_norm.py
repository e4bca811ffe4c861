"""Fused RMSNorm, optionally preceded by the residual add, in one pass over each row.

Grid: one program per row (a token, or a token's head for Qwen3's per-head q/k norm), holding
the whole row in one block of next_power_of_2(hidden) lanes with a mask, so the sum of squares
is a single in-register reduction and the row is read once and written once. The residual
variant also writes x + residual, which the next layer needs, so the unfused add's extra read
and write of the row disappear.

Numerics follow engine.models.llama.rms_norm (HF's formula): the sum x + residual is rounded to
the input dtype (as the unfused add is) before it is normalized; normalization is in float32;
the normalized row is rounded to the input dtype and then scaled by the weight, so half
precision outputs round where HF's do. Outputs are contiguous, in the input dtype; they are fresh
tensors unless the caller passes out / residual_out (which may alias the inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    # Masked lanes hold 0 and add nothing to the sum of squares.
    var = tl.sum(x * x, axis=0) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape); weight [hidden]."""
    out, _ = _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). By default both are fresh tensors and the inputs
    are untouched; out / residual_out may be given, and may alias x / residual for an in-place
    update (a program reads its row before it writes it)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    out, new_residual = _launch(x, residual, weight, eps, out, residual_out)
    assert new_residual is not None
    return out, new_residual


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {n}")
    rows = _as_rows(x)
    out = _output(out, x)
    res_rows = _as_rows(residual) if residual is not None else rows
    res_out = _output(residual_out, x) if residual is not None else out
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight.contiguous(),
            out,
            res_out,
            rows.stride(0),
            res_rows.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out, res_out if residual is not None else None


def _output(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype} tensor")
    return out


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    # A 2-D view with unit stride along the row; copies only when x cannot be viewed so (e.g. a
    # per-head reshape of a q slice of the fused qkv output).
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16
