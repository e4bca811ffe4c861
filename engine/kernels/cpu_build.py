"""Builds the CPU kernels (engine/kernels/*.c) at first use and loads them with ctypes.

Why compiled here rather than shipped: each is built with -march=native, so it uses the widest
vector and integer dot-product instructions the machine has (AVX512-VNNI, AVX-VNNI, AVX2)
without a runtime dispatcher, and a pure-Python wheel stays pure. The shared objects are cached
under $NIGHTSHIFT_HOME/kernels/, keyed by the source, the compiler command and the CPU's model
and flags (a home directory shared between machines must not hand one CPU another's build).

They are linked against the libgomp torch already loaded (same soname), so their OpenMP threads
are torch's pool, and their thread count is torch's, passed on each call (OpenMP's own count is
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
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K")

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def march() -> str:
    """-march for the builds: native, or NIGHTSHIFT_CPU_MARCH (x86-64-v3 is the AVX2 code,
    x86-64 the scalar one; the tests build each)."""
    return os.environ.get("NIGHTSHIFT_CPU_MARCH", "native")


def build(source: Path, march: str) -> ctypes.CDLL:
    """`source` compiled for -march=`march` (cached) and loaded; OSError or SubprocessError if
    it cannot be."""
    if platform.system() != "Linux":
        raise OSError("the kernels' build line is for Linux")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler found (gcc or cc, or $CC)")
    return ctypes.CDLL(str(_build(source, compiler, march)))


def _build(source: Path, compiler: str, march: str) -> Path:
    from engine.model_fetch import nightshift_home

    command = [compiler, *FLAGS, f"-march={march}"]
    # Every kernel source in the folder is in the key: one may #include another.
    sources = b"".join(p.read_bytes() for p in sorted(source.parent.glob("*.c")))
    key = hashlib.sha256(
        source.read_bytes() + sources + " ".join(command).encode() + _cpu_identity().encode()
    ).hexdigest()[:16]
    target = nightshift_home() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: two processes building at once each
    # finish their own file, and neither loads a half-written one.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            [*command, str(source), "-o", str(out), "-lm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode:
            raise subprocess.SubprocessError(done.stderr.strip()[-500:] or "compiler failed")
        os.replace(out, target)
    log.info("built %s", target)
    return target


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


class LoadOnce(Generic[K]):
    """A kernel built and loaded at its first use in the process, by `load` (None: not
    available, the callers keep torch's ops); later calls return the same one. Threads may ask
    at once: one builds, the others wait for it."""

    def __init__(self, load: Callable[[], K | None]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._kernel: K | None = None
        self._tried = False

    def get(self) -> K | None:
        if self._tried:
            return self._kernel
        with self._lock:
            if not self._tried:
                self._kernel = self._load()
                self._tried = True
        return self._kernel

    def forget(self) -> None:
        """Load again at the next use (tests change the environment the loader reads)."""
        with self._lock:
            self._kernel, self._tried = None, False
