"""The CPU's int4/int8 matmuls (cpu_quant_matmul.c), built at first use (engine/kernels/
cpu_build.py) and called via ctypes. No compiler, or a build that fails, leaves `available()`
False and the weights on torch's kernels, with one warning in the log;
NIGHTSHIFT_CPU_QUANT_KERNEL=0 switches it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from engine.kernels import cpu_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant_matmul.c")
BLOCK = 32  # the activations' quantization block; K must be a multiple of it


class Kernel:
    """One build of cpu_quant_matmul.c, loaded."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.ns_int4_tiled_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, i64, i64, ptr, i32]
        lib.ns_int8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i32]
        lib.ns_int4_tiled_matmul.restype = lib.ns_int8_matmul.restype = i32
        lib.ns_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa = lib.ns_isa().decode()

    def int4_tiled_matmul(
        self, x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
        group: int, n: int,
    ) -> torch.Tensor:  # fmt: skip
        """x float32 [M, K] contiguous; tiles uint8 [ceil(N/16), K/32 * 256] and scale, low
        float32 or float16 [ceil(N/16), K/group, 16] (engine/quant/int4.py, tile_codes).
        Returns float32 [M, n]."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        rc = self._lib.ns_int4_tiled_matmul(
            x.data_ptr(), m, k, tiles.data_ptr(), scale.data_ptr(), low.data_ptr(),
            int(scale.dtype == torch.float16), group, n, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "int4", k, group)
        return y

    def int8_matmul(
        self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int
    ) -> torch.Tensor:
        """x float32 [M, K] contiguous; q int8 [N, K]; scale float32 [N, K/group]; float32
        [M, N]."""
        m, k = x.shape
        n = q.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        rc = self._lib.ns_int8_matmul(
            x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), group, n, y.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "int8", k, group)
        return y


def available() -> bool:
    return _kernel() is not None


def isa() -> str:
    """The inner product the built kernel uses ("avx512-vnni", "avx2", ...), or "none"."""
    kernel = _kernel()
    return kernel.isa if kernel is not None else "none"


def int4_tiled_matmul(
    x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int,
    n: int,
) -> torch.Tensor:  # fmt: skip
    return _kernel().int4_tiled_matmul(x, tiles, scale, low, group, n)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return _kernel().int8_matmul(x, q, scale, group)


def fits(k: int, group: int, kind: str) -> bool:
    """Shapes the kernel takes: K in blocks of 32; int4 groups of 32k; int8 groups of 16 or 32k."""
    if k % BLOCK or k % group:
        return False
    return group % BLOCK == 0 or (kind == "int8" and group == 16)


def _check(rc: int, kind: str, k: int, group: int) -> None:
    if rc == -1:
        raise MemoryError(f"{kind} CPU matmul: no memory for the quantized activations")
    if rc:
        raise ValueError(f"{kind} CPU matmul does not take width {k} with groups of {group}")


def _kernel() -> Kernel | None:
    return _loaded.get()


def _load() -> Kernel | None:
    if os.environ.get("NIGHTSHIFT_CPU_QUANT_KERNEL", "1") == "0":
        return None
    try:
        return build(cpu_build.march())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("no CPU quantized-matmul kernel (%s): using torch's kernels", e)
        return None


def build(march: str) -> Kernel:
    """This kernel compiled for -march=`march` (cached): OSError or SubprocessError if not."""
    return Kernel(cpu_build.build(SOURCE, march))


_loaded = cpu_build.LoadOnce(_load)
