"""Int8 weights: w[o, i] = scale[o, i // group] * q[o, i], q in [-127, 127].

Per output channel (group = the input width) is what `--quantization int8` makes; groups of 32
are what a GGUF's Q8_0 blocks hold, 16 its Q6_K's (loaded as they are,
engine/quant/gguf_blocks.py).

The matmul on CPU with float32 activations is our compiled kernel (engine/kernels/cpu_quant.py,
int8 x int8 dot products in blocks of 32, as llama.cpp's Q8_0 x Q8_0), which takes every one of
these groupings as stored. Without it (no compiler, or NIGHTSHIFT_CPU_QUANT_KERNEL=0) it is
torch's
`_weight_int8pack_mm` with bfloat16 activations, which takes one scale per row: grouped codes
are requantized per channel for it, once (see _torch_matmul). On a GPU it is the Triton W8A16
kernel (engine/kernels/quant_matmul.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels import cpu_quant

QMAX = 127


@dataclass(slots=True)
class Int8Weight:
    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in // group]
    group: int
    _kernel_scale: torch.Tensor | None = field(default=None, repr=False)
    _groups_q: torch.Tensor | None = field(default=None, repr=False)  # per-channel codes

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        if self.q.dtype != torch.int8:
            raise ValueError(f"int8 weight codes must be int8, got {self.q.dtype}")
        if self.group < 1 or cols % self.group:
            raise ValueError(f"group {self.group} does not divide the input width {cols}")
        if tuple(self.scale.shape) != (out, cols // self.group):
            raise ValueError(
                f"int8 scales have shape {tuple(self.scale.shape)}, expected "
                f"{(out, cols // self.group)}"
            )
        self.scale = self.scale.float()

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        """What a matmul reads: the codes and a bfloat16 scale per group (as Q8_0 holds it)."""
        return self.q.numel() + 2 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, cols = self.q.shape
        w = self.q.float().view(out, cols // self.group, self.group) * self.scale[..., None]
        return w.view(out, cols).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        out, cols = self.q.shape
        flat = ids.reshape(-1)
        q = self.q[flat].float().view(-1, cols // self.group, self.group)
        return (q * self.scale[flat][..., None]).view(*ids.shape, cols).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and self._own_kernel_fits(x):
            y = cpu_quant.int8_matmul(x.contiguous(), self.q, self.scale, self.group)
        elif x.device.type == "cpu" and x.dim() == 2:
            y = self._torch_matmul(x.to(torch.bfloat16)).to(x.dtype)
        elif x.is_cuda and x.dim() == 2:
            from engine.kernels.quant_matmul import w8a16_matmul

            y = w8a16_matmul(x, self.q, self.scale, self.group)
        else:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)
        return y if bias is None else y + bias

    def _own_kernel_fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == torch.float32
            and cpu_quant.fits(self.q.shape[1], self.group, "int8")
            and cpu_quant.available()
        )

    def _torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        out, cols = self.q.shape
        if self.group == cols:
            if self._kernel_scale is None:
                self._kernel_scale = self.scale[:, 0].to(torch.bfloat16)
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self._kernel_scale)
        # The kernel takes one scale per output row. Running it once per 32-wide group (a
        # GGUF's Q8_0 LM head: 18 calls over 49152 rows) measured 20x slower than one call, so
        # the matmul uses a per-row requantization of these values, made once; lookups (rows)
        # and dequantize keep the exact group-wise values.
        if self._groups_q is None:
            channel = quantize_int8(self.dequantize())
            self._groups_q, self._kernel_scale = channel.q, channel.scale[:, 0].to(torch.bfloat16)
        return torch.ops.aten._weight_int8pack_mm(x, self._groups_q, self._kernel_scale)

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device), self.group)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Stacked along the output dimension (q|k|v, gate|up)."""
        groups = {p.group for p in parts}
        if len(groups) != 1:
            raise ValueError(f"cannot stack int8 weights with groups {sorted(groups)}")
        return Int8Weight(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), groups.pop()
        )

    def slice(self, dim: int, start: int, stop: int) -> Int8Weight:
        """A tensor-parallel shard: rows, or columns on group boundaries."""
        if dim == 0:
            return Int8Weight(self.q[start:stop].contiguous(), self.scale[start:stop], self.group)
        q = self.q[:, start:stop].contiguous()
        if self.group == self.q.shape[1]:  # one scale per row: any columns
            return Int8Weight(q, self.scale, stop - start)
        if start % self.group or stop % self.group:
            raise ValueError(
                f"int8 columns {start}:{stop} do not fall on the weight's {self.group}-wide groups"
            )
        scale = self.scale[:, start // self.group : stop // self.group].contiguous()
        return Int8Weight(q, scale, self.group)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric round-to-nearest: each group's scale maps its largest magnitude to 127."""
    out, cols = w.shape
    group = group or cols
    g = w.float().view(out, cols // group, group)
    scale = g.abs().amax(dim=-1).clamp_min(1e-12) / QMAX
    q = torch.round(g / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q.view(out, cols), scale, group)
