"""The Triton W8A16 / W4A16 GEMMs against the dequantized weight's torch matmul.

Under the interpreter (no GPU) only float32 activations are exact enough to compare; on a GPU
the 16-bit ones run too. Shapes are ragged (rows and columns that are multiples of nothing the
kernel tiles by) and groups of 16 to 128; the output is poisoned first."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (conftest does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.kernels.quant_matmul import w4a16_matmul, w8a16_matmul  # noqa: E402
from engine.quant.int4 import quantize_int4  # noqa: E402
from engine.quant.int8 import quantize_int8  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
SHAPES = [(1, 72, 128, 32), (19, 40, 192, 64), (33, 64, 256, 128)]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _case(m: int, n: int, k: int, dtype: torch.dtype):
    torch.manual_seed(m * 7 + n)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k).to(dtype).to(DEVICE)
    return w, x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES + [(5, 24, 96, 96)])
def test_w8a16_matches_dequantized(m, n, k, group, dtype) -> None:
    w, x = _case(m, n, k, dtype)
    qw = quantize_int8(w, group).to(torch.device(DEVICE))
    y = w8a16_matmul(x, qw.q, qw.scale, qw.group)
    ref = x.float() @ qw.dequantize().T
    assert y.dtype == dtype and y.shape == (m, n)
    assert (y.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES + [(3, 16, 64, 16)])
def test_w4a16_matches_dequantized(m, n, k, group, dtype) -> None:
    w, x = _case(m, n, k, dtype)
    qw = quantize_int4(w, group).to(torch.device(DEVICE))
    y = w4a16_matmul(x, qw.packed, qw.scale, qw.low, qw.group)
    ref = x.float() @ qw.dequantize().T
    assert y.dtype == dtype and y.shape == (m, n)
    assert (y.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


def test_bad_shapes_are_named() -> None:
    qw = quantize_int8(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        w8a16_matmul(torch.randn(2, 32), qw.q, qw.scale, 32)
