"""fp8 (e4m3) weights with one scale per output channel: w[o, i] = scale[o] * q[o, i].

On a GPU with fp8 tensor cores (compute capability 8.9 and up) the matmul is torch._scaled_mm
with the activations quantized per token (what vLLM's fp8 does). Elsewhere the codes are widened:
every e4m3 value is exact in bfloat16 (3 mantissa bits, a smaller exponent range), so a bfloat16
copy computes the fp8 model exactly at twice the bytes; this CPU has no fp8 arithmetic (torch's
CPU _scaled_mm measured 30 ms for one row of a 1536 x 576 weight)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@dataclass(slots=True)
class Fp8Weight:
    q: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out, 1]
    _wide: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.q.dtype != E4M3:
            raise ValueError(f"fp8 weight codes must be float8_e4m3fn, got {self.q.dtype}")
        if tuple(self.scale.shape) != (self.q.shape[0], 1):
            raise ValueError(
                f"fp8 scales have shape {tuple(self.scale.shape)}, expected {(self.q.shape[0], 1)}"
            )
        self.scale = self.scale.float()

    group = property(lambda self: self.q.shape[1])

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.q[flat].float() * self.scale[flat]
        return rows.view(*ids.shape, self.q.shape[1]).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and _has_fp8(x.device):
            y = self._scaled_mm(x)
        else:
            if self._wide is None:
                self._wide = self.q.to(torch.bfloat16)  # exact
            y = (torch.nn.functional.linear(x.to(torch.bfloat16), self._wide) * self.scale.t()).to(
                x.dtype
            )
        return y if bias is None else y + bias

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        x_scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / E4M3_MAX
        xq = (x / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return torch._scaled_mm(
            xq, self.q.t(), scale_a=x_scale, scale_b=self.scale.t(), out_dtype=x.dtype
        )

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device))

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    def slice(self, dim: int, start: int, stop: int) -> Fp8Weight:
        if dim == 0:
            return Fp8Weight(self.q[start:stop].contiguous(), self.scale[start:stop])
        return Fp8Weight(self.q[:, start:stop].contiguous(), self.scale)


@functools.cache
def _has_fp8(device: torch.device) -> bool:
    """fp8 tensor cores (compute capability 8.9+): asked once per device, not per matmul."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: the row's largest magnitude maps to e4m3's largest finite value."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return Fp8Weight((w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)
