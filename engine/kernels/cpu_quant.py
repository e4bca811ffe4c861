"""The CPU's int4/int8 matmuls (cpu_quant_matmul.c), compiled at first use and called via ctypes.

Why compiled here rather than shipped: the kernel is built with -march=native, so it uses the
widest integer dot product the machine has (AVX512-VNNI, AVX-VNNI, AVX2) without a runtime
dispatcher, and a pure-Python wheel stays pure. The shared object is cached under
$NIGHTSHIFT_HOME/kernels/, keyed by the source, the compiler command and the CPU's model and
flags (a home directory shared between machines must not hand one CPU another's build). No
compiler, or a build that fails, leaves `available()` False and the weights on torch's kernels,
with one warning in the log; NIGHTSHIFT_CPU_QUANT_KERNEL=0 asks for torch's kernels outright.

It is linked against the libgomp torch already loaded (same soname), so its OpenMP threads are
torch's pool and its thread count is torch's (passed on each call: OpenMP's own count is
per-thread state, and the engine may run on a thread that never set it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant_matmul.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
BLOCK = 32  # the activations' quantization block; K must be a multiple of it

_lock = threading.Lock()
_default: Kernel | None = None
_tried = False


class Kernel:
    """One build of cpu_quant_matmul.c, loaded."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.ns_int4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, i64, i64, ptr, i32]
        lib.ns_int8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i32]
        lib.ns_int4_matmul.restype = lib.ns_int8_matmul.restype = i32
        lib.ns_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa = lib.ns_isa().decode()

    def int4_matmul(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
        group: int,
    ) -> torch.Tensor:  # fmt: skip
        """x float32 [M, K] contiguous; codes uint8 [N, K/2]; scale, low float32 or float16
        [N, K/group] (both the same dtype). Returns float32 [M, N]."""
        m, k = x.shape
        n = codes.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        rc = self._lib.ns_int4_matmul(
            x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), low.data_ptr(),
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


def int4_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int
) -> torch.Tensor:
    return _kernel().int4_matmul(x, codes, scale, low, group)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return _kernel().int8_matmul(x, q, scale, group)


def fits(k: int, group: int, kind: str) -> bool:
    """Shapes the kernel takes: K in blocks of 32; int4 groups of 32k; int8 groups of 16 or 32k."""
    if k % BLOCK or k % group:
        return False
    return group % BLOCK == 0 or (kind == "int8" and group == 16)


def march() -> str:
    """-march for the build: native, or NIGHTSHIFT_CPU_QUANT_MARCH (x86-64-v3 is the AVX2 code,
    x86-64 the scalar one; the tests build each)."""
    return os.environ.get("NIGHTSHIFT_CPU_QUANT_MARCH", "native")


def _check(rc: int, kind: str, k: int, group: int) -> None:
    if rc == -1:
        raise MemoryError(f"{kind} CPU matmul: no memory for the quantized activations")
    if rc:
        raise ValueError(f"{kind} CPU matmul does not take width {k} with groups of {group}")


def _kernel() -> Kernel | None:
    global _default, _tried
    if _tried:
        return _default
    with _lock:
        if not _tried:
            _default = _load()
            _tried = True
    return _default


def _load() -> Kernel | None:
    if os.environ.get("NIGHTSHIFT_CPU_QUANT_KERNEL", "1") == "0":
        return None
    try:
        return build(march())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("no CPU quantized-matmul kernel (%s): using torch's kernels", e)
        return None


def build(march: str) -> Kernel:
    """The kernel compiled for -march=`march` (cached); OSError or SubprocessError if it
    cannot be."""
    if platform.system() != "Linux":
        raise OSError("the kernel's build line is for Linux")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler found (gcc or cc, or $CC)")
    return Kernel(ctypes.CDLL(str(_build(compiler, march))))


def _build(compiler: str, march: str) -> Path:
    from engine.model_fetch import nightshift_home

    command = [compiler, *FLAGS, f"-march={march}"]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(command).encode() + _cpu_identity().encode()
    ).hexdigest()[:16]
    target = nightshift_home() / "kernels" / f"cpu_quant_matmul-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: two processes building at once each
    # finish their own file, and neither loads a half-written one.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            [*command, str(SOURCE), "-o", str(out), "-lm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode:
            raise subprocess.SubprocessError(done.stderr.strip()[-500:] or "compiler failed")
        os.replace(out, target)
    log.info("built the CPU quantized-matmul kernel: %s", target)
    return target


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))
