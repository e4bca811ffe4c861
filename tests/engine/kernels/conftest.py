"""Kernel tests run on the CPU under the Triton interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere (triton.jit decides at
definition time), hence at the top of this conftest, which pytest imports before the test
modules of this directory. Without triton installed the directory is skipped.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: E402, F401
except ImportError:  # triton is a dev dependency on Linux only: skip this directory's tests
    collect_ignore_glob = ["test_*.py"]
