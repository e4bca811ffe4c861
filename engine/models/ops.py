"""The seam between the decoder and its non-attention element-wise ops.

Implementations with the same methods: TorchOps, plain torch (the reference in tests), CpuOps,
TorchOps with fused C kernels for float32 on the CPU (the CPU path), and TritonOps, the fused
kernels in engine/kernels (the GPU path).
The model holds one and calls ops.rms_norm / add_rms_norm / rotary / silu_and_mul; which one
is a configuration choice made once, by make_ops.

Shared contract: outputs are in the input's dtype; add_rms_norm returns (normed, x + residual)
as fresh tensors and modifies neither input. Rotary is two calls: `rotary_inputs(positions,
cos_sin)` once per step (positions [T], the whole float32 table [max_positions, 2, D] from
engine.models.rotary.cos_sin_cache), then `rotary(qk, inputs)` per layer on qk [T, H, D] (unit
stride along D), which returns the rotated tensor: torch gathers the step's cos/sin rows once
and rotates out of place (the fastest on CPU), Triton rotates in place reading the table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.rotary import apply_rotary

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AddNorm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


class TorchOps:
    """Calls the torch functions the model uses today (engine.models.llama, .rotary)."""

    name = "torch"

    def __init__(self) -> None:
        # Imported here, not at module level: llama.py imports this module, so a top-level
        # import back would be circular. By the time an ops object is built both are loaded.
        from engine.models.llama import _add_norm, rms_norm

        self._rms_norm: Norm = rms_norm
        self._add_norm: AddNorm = _add_norm

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_norm(x, residual, w, eps)

    def rotary_inputs(
        self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = cos_sin[positions]
        return table[:, None, 0].to(dtype), table[:, None, 1].to(dtype)

    def rotary(self, qk: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return apply_rotary(qk, *inputs)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class CpuOps(TorchOps):
    """TorchOps with the fused float32 CPU kernels (engine/kernels/cpu_ops.c) for the norms and
    SiLU-and-mul: one call each instead of several torch ops, which at a decode step's few rows
    is mostly dispatch. Other dtypes and devices, and rotary, stay on torch."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        from engine.kernels import cpu_ops

        self._kernel = cpu_ops.kernel()

    def _fused(self, x: torch.Tensor) -> bool:
        return self._kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu"

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self._fused(x) and w.dtype == torch.float32:
            return self._kernel.rms_norm(x, w, eps)
        return super().rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused(x) and residual.dtype == w.dtype == torch.float32:
            return self._kernel.add_rms_norm(x, residual, w, eps)
        return super().add_rms_norm(x, residual, w, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._fused(gate_up):
            return self._kernel.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)


class TritonOps:
    """Fused Triton kernels; tensors must be on a CUDA device (or TRITON_INTERPRET=1 on CPU)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here so that the torch path never needs triton installed.
        from engine.kernels.rms_norm import add_rms_norm, rms_norm
        from engine.kernels.rotary import apply_rotary_inplace
        from engine.kernels.silu_mul import silu_and_mul

        self._rms_norm: Norm = rms_norm
        self._add_rms_norm: AddNorm = add_rms_norm
        self._rotary = apply_rotary_inplace
        self._silu_and_mul = silu_and_mul

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms_norm(x, residual, w, eps)

    def rotary_inputs(
        self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, cos_sin

    def rotary(self, qk: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self._rotary(qk, *inputs)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)


def make_ops(kind: str) -> TorchOps | TritonOps:
    """The ops implementation by name: "torch" (reference), "cpu" (torch with fused C kernels)
    or "triton" (fused GPU kernels)."""
    if kind == "torch":
        return TorchOps()
    if kind == "cpu":
        return CpuOps()
    if kind == "triton":
        return TritonOps()
    raise ValueError(f"unknown ops kind {kind!r} (expected 'torch', 'cpu' or 'triton')")
