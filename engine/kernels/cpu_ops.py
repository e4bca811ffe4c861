"""The decoder's fused float32 CPU ops (cpu_ops.c): RMSNorm with the residual add, SiLU-and-mul,
paged decode attention. Built at first use (engine/kernels/cpu_build.py); without a compiler, or
with NIGHTSHIFT_CPU_OPS=0, `available()` is False and the model keeps torch's ops.

Contracts are TorchOps' (engine/models/ops.py) for the norms and SiLU, and the torch attention
backend's for decode: inputs are float32 CPU tensors, contiguous in their last dimension."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from engine.kernels import cpu_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")


class CpuOpsKernel:
    """One build of cpu_ops.c, loaded."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.ns_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, f32, ptr, ptr, i32]
        lib.ns_silu_mul.argtypes = [ptr, i64, i64, ptr, i32]
        lib.ns_paged_decode.argtypes = [
            ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, f32, ptr, i32,
        ]  # fmt: skip
        for f in (lib.ns_rms_norm, lib.ns_silu_mul, lib.ns_paged_decode):
            f.restype = None
        self._lib = lib

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        self._lib.ns_rms_norm(
            x.data_ptr(), None, w.data_ptr(), x.numel() // n, n, eps, out.data_ptr(), None,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = x.contiguous(), residual.contiguous()
        out, total = torch.empty_like(x), torch.empty_like(x)
        n = x.shape[-1]
        self._lib.ns_rms_norm(
            x.data_ptr(), residual.data_ptr(), w.data_ptr(), x.numel() // n, n, eps,
            out.data_ptr(), total.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out, total

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        n = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], n)
        self._lib.ns_silu_mul(
            gate_up.data_ptr(), gate_up.numel() // (2 * n), n, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def paged_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [reqs, Hq, D], one token each; pools [blocks, block_size, Hkv, D]; block_tables
        [reqs, max_blocks] and seq_lens [reqs] int64 -> [reqs, Hq, D]."""
        q = q.contiguous()
        reqs, hq, d = q.shape
        _, block_size, hkv, _ = k_pool.shape
        tables = block_tables.contiguous()
        lens = seq_lens.contiguous()
        out = torch.empty_like(q)
        self._lib.ns_paged_decode(
            q.data_ptr(), reqs, hq, hkv, d, k_pool.data_ptr(), v_pool.data_ptr(), block_size,
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), scale, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def available() -> bool:
    return kernel() is not None


def kernel() -> CpuOpsKernel | None:
    return _loaded.get()


def build(march: str) -> CpuOpsKernel:
    """This kernel compiled for -march=`march` (cached): OSError or SubprocessError if not."""
    return CpuOpsKernel(cpu_build.build(SOURCE, march))


def _load() -> CpuOpsKernel | None:
    if os.environ.get("NIGHTSHIFT_CPU_OPS", "1") == "0":
        return None
    try:
        return build(cpu_build.march())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("no fused CPU ops (%s): using torch's", e)
        return None


_loaded = cpu_build.LoadOnce(_load)
