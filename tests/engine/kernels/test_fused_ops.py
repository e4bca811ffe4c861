"""Fused RMSNorm, rotary and SiLU-and-mul kernels against the torch code the model runs today.

On the CPU the kernels run under the Triton interpreter, which is slow (about a second a call)
and computes bf16 wrongly, so shapes are small and bf16 runs only on a GPU. Shapes are ragged on
purpose: token counts that are multiples of nothing, hidden sizes that are not powers of two,
unsorted positions. Outputs are poisoned with NaN first, so an element a kernel never writes fails.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (conftest does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.kernels.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from engine.kernels.rotary import apply_rotary_inplace  # noqa: E402
from engine.kernels.silu_mul import silu_and_mul  # noqa: E402
from engine.models.model_config import RopeConfig  # noqa: E402
from engine.models.ops import TorchOps, TritonOps, make_ops  # noqa: E402
from engine.models.rotary import cos_sin_cache  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 needs a GPU")),
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
EPS = 1e-6
REF = TorchOps()

DEFAULT_ROPE = RopeConfig(theta=10000.0)
# As model_config._parse_rope builds it; a small original context puts the head's frequencies
# in all three llama3 bands (kept, blended, slowed).
LLAMA3_ROPE = RopeConfig(
    theta=10000.0,
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=256,
)
MAX_POSITIONS = 4096


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def _weight(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(n, generator=gen)).to(DEVICE, dtype)


# (7, 96): ragged tokens; (5, 576): hidden not a power of two; (3, 4, 64): Qwen3's per-head norm.
NORM_SHAPES = [(7, 96), (5, 576), (3, 4, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x, w = _rand(gen, *shape, dtype=dtype), _weight(gen, shape[-1], dtype)
    out = _poisoned(shape, dtype)
    assert rms_norm(x, w, EPS, out=out) is out
    _close(out, REF.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_strided_view(dtype: torch.dtype) -> None:
    # The model normalizes q heads viewed inside the fused qkv output: rows are not contiguous.
    gen = torch.Generator().manual_seed(1)
    qkv = _rand(gen, 7, 5 * 64, dtype=dtype)
    q = qkv[:, : 3 * 64].reshape(7, 3, 64)
    w = _weight(gen, 64, dtype)
    before = qkv.clone()
    _close(rms_norm(q, w, EPS), REF.rms_norm(q, w, EPS))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES[:2])
def test_add_rms_norm_returns_norm_and_sum(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x, residual = _rand(gen, *shape, dtype=dtype), _rand(gen, *shape, dtype=dtype)
    w = _weight(gen, shape[-1], dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = _poisoned(shape, dtype), _poisoned(shape, dtype)
    normed, summed = add_rms_norm(x, residual, w, EPS, out=out, residual_out=residual_out)
    assert normed is out and summed is residual_out
    want_normed, want_summed = REF.add_rms_norm(x, residual, w, EPS)
    _close(normed, want_normed)
    _close(summed, want_summed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_add_rms_norm_may_write_over_its_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    x, residual, w = _rand(gen, 7, 96), _rand(gen, 7, 96), _weight(gen, 96, torch.float32)
    want_normed, want_summed = REF.add_rms_norm(x, residual, w, EPS)
    normed, summed = add_rms_norm(x, residual, w, EPS, out=x, residual_out=residual)
    assert normed is x and summed is residual
    _close(normed, want_normed)
    _close(summed, want_summed)


# (tokens, query heads, kv heads, head_dim): the brief's GQA shape; a half (40) that is not a
# power of two; more heads than one program's block (16), so the head grid has a ragged tail.
ROTARY_SHAPES = [(7, 3, 1, 64), (5, 4, 2, 80), (3, 16, 4, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [DEFAULT_ROPE, LLAMA3_ROPE], ids=["default", "llama3"])
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_in_place_on_the_qk_view(
    shape: tuple[int, int, int, int], rope: RopeConfig, dtype: torch.dtype
) -> None:
    tokens, q_heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    qkv = _rand(gen, tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    # Unsorted, with repeats possible, and reaching far beyond the llama3 original context.
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen).to(DEVICE)
    positions[0] = MAX_POSITIONS - 1
    cos_sin = cos_sin_cache(rope, head_dim, MAX_POSITIONS).to(DEVICE)
    v_before = qkv[:, qk.shape[1] * head_dim :].clone()
    expected = REF.rotary(qk.clone(), REF.rotary_inputs(positions, cos_sin, dtype))

    assert apply_rotary_inplace(qk, positions, cos_sin) is qk
    _close(qk, expected)
    assert torch.equal(qkv[:, qk.shape[1] * head_dim :], v_before)  # v is left alone


def test_llama3_table_differs_from_default() -> None:
    # Guards the rotary test above: the two rope kinds must give different tables.
    default = cos_sin_cache(DEFAULT_ROPE, 64, 512)
    llama3 = cos_sin_cache(LLAMA3_ROPE, 64, 512)
    assert not torch.allclose(default, llama3, atol=1e-3)


# (tokens, intermediate): ragged; two blocks of 1024 with a masked tail; tiny and odd-sized.
SILU_SHAPES = [(7, 96), (5, 1536), (3, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_and_mul(shape: tuple[int, int], dtype: torch.dtype) -> None:
    tokens, inter = shape
    gen = torch.Generator().manual_seed(tokens + inter)
    gate_up = 3 * _rand(gen, tokens, 2 * inter, dtype=dtype)  # reach silu's flat and steep parts
    out = _poisoned((tokens, inter), dtype)
    assert silu_and_mul(gate_up, out=out) is out
    _close(out, REF.silu_and_mul(gate_up))


def test_empty_batches_launch_nothing() -> None:
    x = torch.empty(0, 96, device=DEVICE)
    w = torch.ones(96, device=DEVICE)
    assert rms_norm(x, w, EPS).shape == (0, 96)
    assert add_rms_norm(x, x, w, EPS)[1].shape == (0, 96)
    assert silu_and_mul(torch.empty(0, 192, device=DEVICE)).shape == (0, 96)
    qk = torch.empty(0, 4, 64, device=DEVICE)
    table = cos_sin_cache(DEFAULT_ROPE, 64, 8).to(DEVICE)
    positions = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert apply_rotary_inplace(qk, positions, table) is qk


def test_torch_and_triton_ops_agree() -> None:
    torch_ops, triton_ops = make_ops("torch"), make_ops("triton")
    assert isinstance(torch_ops, TorchOps) and isinstance(triton_ops, TritonOps)
    gen = torch.Generator().manual_seed(11)
    x, residual, w = _rand(gen, 7, 96), _rand(gen, 7, 96), _weight(gen, 96, torch.float32)
    _close(triton_ops.rms_norm(x, w, EPS), torch_ops.rms_norm(x, w, EPS))
    for got, want in zip(
        triton_ops.add_rms_norm(x, residual, w, EPS), torch_ops.add_rms_norm(x, residual, w, EPS)
    ):
        _close(got, want)
    gate_up = _rand(gen, 7, 2 * 96)
    _close(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up))

    qk = _rand(gen, 7, 4, 64)
    positions = torch.tensor([5, 0, 300, 2, 2, 1023, 17], device=DEVICE)
    cos_sin = cos_sin_cache(LLAMA3_ROPE, 64, 1024).to(DEVICE)
    expected = torch_ops.rotary(qk.clone(), torch_ops.rotary_inputs(positions, cos_sin, qk.dtype))
    rotated = triton_ops.rotary(qk, triton_ops.rotary_inputs(positions, cos_sin, qk.dtype))
    assert rotated is qk  # in place on the Triton side
    _close(qk, expected)


def test_make_ops_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown ops kind"):
        make_ops("cuda")
