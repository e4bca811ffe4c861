"""The compiled CPU int4/int8 matmuls (engine/kernels/cpu_quant_matmul.c) against an exact
reference: the activations quantized to int8 in blocks of 32 the kernel's way (round to nearest,
one scale per block from its largest magnitude), then the integer dot products scaled per block.
What is left between the two is float32 summation order, so the tolerance is tight (1e-5 of
the output's size); each build the machine can run is checked: native, AVX2, scalar."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from engine.kernels import cpu_quant
from engine.quant.int4 import quantize_int4, tile_codes, untile_codes
from engine.quant.int8 import quantize_int8

MARCHES = ["native", "x86-64-v3", "x86-64"] if platform.machine() == "x86_64" else ["native"]
needs_compiler = pytest.mark.skipif(
    platform.system() != "Linux" or not (shutil.which("gcc") or shutil.which("cc")),
    reason="the CPU kernel is built with a C compiler on Linux",
)


@pytest.fixture(scope="module", params=MARCHES)
def kernel(request) -> cpu_quant.Kernel:
    if request.param == "x86-64-v3" and "avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    return cpu_quant.build(request.param)


def _cpu_flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


def quantize_acts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> int codes [M, K/32, 32] and scales [M, K/32], as the kernel makes them."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inv[..., None]).to(torch.int64), d


def int4_reference(x: torch.Tensor, w) -> torch.Tensor:
    qx, d = quantize_acts(x)  # [M, B, 32]
    n, k = w.shape
    codes = w.codes().to(torch.int64).view(n, k // 32, 32)
    isum = torch.einsum("mbi,nbi->mnb", qx.double(), codes.double())
    per = w.group // 32
    scale = w.scale.double().repeat_interleave(per, dim=1)  # [N, B]
    low = w.low.double().repeat_interleave(per, dim=1)
    xsum = qx.sum(-1).double() * d.double()  # [M, B]
    y = (isum * scale[None] * d.double()[:, None]).sum(-1) + xsum @ low.t()
    return y.float()


def int8_reference(x: torch.Tensor, w) -> torch.Tensor:
    qx, d = quantize_acts(x)
    n, k = w.shape
    prod = qx.double()[:, None] * w.q.double().view(n, k // 32, 32)[None]  # [M, N, B, 32]
    scale = w.scale.double().repeat_interleave(w.group, dim=1).view(n, k // 32, 32)
    return (prod * scale[None] * d.double()[:, None, :, None]).sum((-1, -2)).float()


def int4(kernel, x: torch.Tensor, w, scale=None, low=None) -> torch.Tensor:
    """The kernel on w's codes, tiled (its only int4 layout)."""
    tiles, s, lo = tile_codes(w.codes(), w.scale if scale is None else scale,
                              w.low if low is None else low, w.group)  # fmt: skip
    return kernel.int4_tiled_matmul(x, tiles, s, lo, w.group, w.shape[0])


def close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape
    err = (y - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item() + 1e-6, err


@needs_compiler
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("n,k,group", [(48, 64, 32), (37, 128, 64), (7, 256, 128), (20, 96, 32)])
def test_int4_matches_exact_reference(kernel, m, n, k, group):
    # rows past a multiple of 16 (37, 7, 20) are a tile's padding; 9 activation rows are two
    # passes of four and one of one
    torch.manual_seed(m * 1000 + n)
    w, x = quantize_int4(torch.randn(n, k), group), torch.randn(m, k)
    close(int4(kernel, x, w), int4_reference(x, w))


@pytest.mark.parametrize("n,k", [(16, 64), (37, 128), (5, 32)])
def test_tiled_layout_round_trips(n, k):
    w = quantize_int4(torch.randn(n, k), 32)
    tiles, scale, low = tile_codes(w.codes(), w.scale, w.low, 32)
    assert tiles.shape == (-(-n // 16), k // 32 * 256)
    assert scale.shape == low.shape == (-(-n // 16), k // 32, 16)
    assert torch.equal(untile_codes(tiles, n, k), w.codes())
    # byte (j, r, k) of tile 0, block 0: row r's inputs 4j + k (low) and 16 + 4j + k (high)
    codes = w.codes()
    assert tiles[0, (2 * 16 + 3) * 4 + 1] == codes[3, 9] | (codes[3, 25] << 4)


@needs_compiler
def test_int4_float16_scales_read_as_float16(kernel):
    torch.manual_seed(1)
    w, x = quantize_int4(torch.randn(64, 128), 32), torch.randn(3, 128)
    w.scale, w.low = w.scale.half().float(), w.low.half().float()  # representable exactly
    close(int4(kernel, x, w, w.scale.half(), w.low.half()), int4_reference(x, w))


@needs_compiler
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("group", [16, 32, 64, None])
def test_int8_matches_exact_reference(kernel, m, group):
    torch.manual_seed(m + (group or 0))
    w, x = quantize_int8(torch.randn(23, 128), group), torch.randn(m, 128)
    close(kernel.int8_matmul(x, w.q, w.scale, w.group), int8_reference(x, w))


@needs_compiler
def test_zero_and_extreme_activations(kernel):
    # A block of zeros has scale 0 (no division by it); the largest magnitude maps to +-127.
    w = quantize_int8(torch.randn(16, 64))
    x = torch.zeros(2, 64)
    x[1, :32] = 1e4
    x[1, 32] = -3.0
    close(kernel.int8_matmul(x, w.q, w.scale, w.group), int8_reference(x, w))
    w4 = quantize_int4(torch.randn(16, 64), 32)
    close(int4(kernel, x, w4), int4_reference(x, w4))


@needs_compiler
def test_thread_counts_agree():
    kernel = cpu_quant.build("native")
    w, x = quantize_int4(torch.randn(100, 256), 32), torch.randn(4, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4(kernel, x, w)
        torch.set_num_threads(2)
        two = int4(kernel, x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # rows are split between threads, never a sum


@needs_compiler
def test_shapes_it_does_not_take_are_refused(kernel):
    w = quantize_int8(torch.randn(8, 48))  # 48 is not a multiple of 32
    with pytest.raises(ValueError, match="width 48"):
        kernel.int8_matmul(torch.randn(1, 48), w.q, w.scale, w.group)
    assert not cpu_quant.fits(48, 48, "int8")
    assert cpu_quant.fits(64, 16, "int8") and not cpu_quant.fits(64, 16, "int4")


@pytest.fixture
def kernel_on(monkeypatch):
    """The kernel loaded afresh for this test (and again after it), as the process would."""
    monkeypatch.delenv("NIGHTSHIFT_CPU_QUANT_KERNEL", raising=False)
    cpu_quant._loaded.forget()
    yield
    cpu_quant._loaded.forget()


def test_on_unless_switched_off(monkeypatch, kernel_on):
    monkeypatch.setenv("NIGHTSHIFT_CPU_QUANT_KERNEL", "0")
    assert not cpu_quant.available()
    w, x = quantize_int4(torch.randn(64, 128), 32), torch.randn(2, 128)
    assert not w.tiled_kernel_fits()  # torch's kernel
    ref = x @ w.dequantize().t()
    assert (w.linear(x) - ref).norm() / ref.norm() < 0.02


@needs_compiler
def test_quantized_linear_uses_it_where_chosen_and_stays_close_to_float(kernel_on):
    # Int8Weight.linear on float32 CPU activations goes through the kernel; Int4Weight too where
    # it is built with AVX512-VNNI (measured faster than torch's at every row count), elsewhere
    # only for rows not in 16s (torch's kernel's constraint).
    assert cpu_quant.available(), "the default build should load on this machine"
    torch.manual_seed(3)
    x = torch.randn(3, 256)
    w8 = quantize_int8(torch.randn(64, 256), 32)
    assert torch.equal(w8.linear(x), cpu_quant.int8_matmul(x, w8.q, w8.scale, 32))
    w4 = quantize_int4(torch.randn(40, 256), 32)  # 40 rows: not torch's kernel's
    expected = int4(cpu_quant._kernel(), x, w4)
    assert torch.equal(w4.linear(x), expected)
    assert w4.packed is None  # the tiles are the only copy of the codes now
    w64 = quantize_int4(torch.randn(64, 256), 32)
    assert w64.tiled_kernel_fits() == (cpu_quant.isa() == "avx512-vnni")
    for w in (w8, w4, w64):
        ref = x @ w.dequantize().t()
        assert (w.linear(x) - ref).norm() / ref.norm() < 0.02


@needs_compiler
def test_cache_key_changes_with_march(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))
    cpu_quant.build("x86-64" if platform.machine() == "x86_64" else "native")
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1
    cpu_quant.build("native")
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2 - (platform.machine() != "x86_64")


def test_without_a_compiler_linear_falls_back_to_torch(tmp_path, monkeypatch, caplog, kernel_on):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))  # no cached build to find
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        cpu_quant.build("native")
    with caplog.at_level("WARNING", logger="engine.kernels.cpu_quant"):
        assert not cpu_quant.available()
    assert "no CPU quantized-matmul kernel" in caplog.text
    torch.manual_seed(4)
    w, x = quantize_int4(torch.randn(64, 128), 32), torch.randn(2, 128)
    ref = x @ w.dequantize().t()
    assert (w.linear(x) - ref).norm() / ref.norm() < 0.02  # torch's bfloat16 kernel
