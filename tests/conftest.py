"""Suite-wide setup that must happen before any test module is imported.

Triton decides at import time whether `@triton.jit` functions run compiled or interpreted, and
some libraries (transformers, torch) import it on their own while other test modules load. On a
machine without CUDA the kernels can only run under the interpreter, so choose it here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
