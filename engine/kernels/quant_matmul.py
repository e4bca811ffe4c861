"""Weight-only quantized GEMMs for the GPU: y = x @ dequant(W)^T with 16-bit activations.

W8A16: W[n, k] = scale[n, k // G] * q[n, k], q int8 [N, K].
W4A16: W[n, k] = scale[n, k // G] * c[n, k] + low[n, k // G], c in [0, 15] packed two a byte
along k ([N, K // 2] uint8, the even k in the low nibble): engine/quant/int4.py's layout.

Each program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads the
codes of a [BLOCK_N, BLOCK_K] weight tile (a quarter or an eighth of the 16-bit bytes: the point
at decode, where the GEMM streams the weights once per step), widens them to the activations'
dtype with their group's scale (and low), and accumulates tl.dot in float32. BLOCK_K divides
the group size or the group size divides BLOCK_K, so a tile's scales are one per group column:
they are loaded as a [BLOCK_N, BLOCK_K] gather of k // G, which the cache serves.

The launch picks BLOCK_M by the row count (16 for decode batches, up to 64 for prefill), and
BLOCK_N = 64, BLOCK_K = min(64, G) or 64; a grid of (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
Tested under TRITON_INTERPRET=1 against the dequantized torch matmul
(tests/engine/kernels/test_quant_matmul.py); rates on a GPU come from ops/gpu_check.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w8a16_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, G,
    stride_xm, stride_qn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        wmask = (rn[:, None] < N) & (kk[None, :] < K)
        q = tl.load(q_ptr + rn[:, None] * stride_qn + kk[None, :], mask=wmask, other=0)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + kk[None, :] // G, mask=wmask, other=0.0)
        w = (q.to(tl.float32) * s).to(dtype)
        acc += tl.dot(x, tl.trans(w))
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(dtype),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _w4a16_kernel(
    x_ptr, p_ptr, s_ptr, l_ptr, y_ptr, M, N, K, G,
    stride_xm, stride_pn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rh = tl.arange(0, BLOCK_K // 2)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        hh = k0 // 2 + rh
        pmask = (rn[:, None] < N) & (hh[None, :] < K // 2)
        p = tl.load(p_ptr + rn[:, None] * stride_pn + hh[None, :], mask=pmask, other=0)
        # Byte j holds codes 2j (low nibble) and 2j + 1 (high): join them back in k order.
        codes = tl.join(p & 0x0F, p >> 4).reshape(BLOCK_N, BLOCK_K)
        wmask = (rn[:, None] < N) & (kk[None, :] < K)
        g = rn[:, None] * stride_sn + kk[None, :] // G
        s = tl.load(s_ptr + g, mask=wmask, other=0.0)
        low = tl.load(l_ptr + g, mask=wmask, other=0.0)
        w = (codes.to(tl.float32) * s + low).to(dtype)
        acc += tl.dot(x, tl.trans(w))
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(dtype),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _blocks(m: int, group: int) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = min(64, group) if group >= 16 else 64
    return block_m, 64, block_k


def _check(x: torch.Tensor, n: int, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")


def w8a16_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ (scale * q)^T -> [M, N] in x's dtype."""
    n, k = q.shape
    _check(x, n, k)
    x, q, scale = x.contiguous(), q.contiguous(), scale.float().contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    bm, bn, bk = _blocks(x.shape[0], group)
    grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(n, bn))
    _w8a16_kernel[grid](
        x, q, scale, y, x.shape[0], n, k, group,
        x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return y


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] @ (scale * codes + low)^T -> [M, N] in x's dtype."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    _check(x, n, k)
    x, packed = x.contiguous(), packed.contiguous()
    scale, low = scale.float().contiguous(), low.float().contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    bm, bn, bk = _blocks(x.shape[0], group)
    grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(n, bn))
    _w4a16_kernel[grid](
        x, packed, scale, low, y, x.shape[0], n, k, group,
        x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return y
