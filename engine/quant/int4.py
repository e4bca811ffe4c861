"""Int4 weights in groups: w[o, i] = scale[o, g] * q[o, i] + low[o, g], g = i // group, q in
[0, 15]. One formula holds GGUF's Q4_1 (scale d, low m) and Q4_0 (low = -8 d), symmetric int4
(low = -8 scale) and asymmetric int4 alike.

Stored packed two codes a byte along the input (the even input in the low nibble), what the
quantized folder writes (engine/quant/checkpoint.py). The CPU matmul, with float32 activations,
is chosen by measurement (docs/PERFORMANCE.md, "int4 matmuls on the CPU"):
- where our compiled kernel is built with AVX512-VNNI, ours on a row-tiled copy of the codes
  (engine/kernels/cpu_quant_matmul.c, ns_int4_tiled_matmul: int8 activations, 16 weight rows a
  vpdpbusd), 1.3-2x faster than torch's at every row count from 1 to 128 on the default model's
  shapes;
- elsewhere torch's `_weight_int4pack_mm_for_cpu` on bfloat16 activations (its only fast input
  dtype: float32 runs 30x slower) on its own blocked layout, and our kernel on the stored layout
  for the shapes torch's does not take (rows not in 16s).
Either CPU layout is made once at first use and then is the only copy of the codes (`stored`
reads them back). On a GPU it is the Triton W4A16 kernel (engine/kernels/quant_matmul.py) on the
stored layout."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.kernels import cpu_quant


@dataclass(slots=True)
class Int4Weight:
    # uint8 [out, in // 2]; None once the CPU kernel's layout is made (the codes are kept once:
    # they come back from that layout when asked for, see `stored`)
    packed: torch.Tensor | None
    scale: torch.Tensor  # float32 [out, in // group]
    low: torch.Tensor  # float32 [out, in // group]
    group: int
    _cpu: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # (tiles, scale, low) of tile_codes, for our AVX512-VNNI kernel
    _tiled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _kernel_scales: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        out, half = self.packed.shape  # built from stored codes; the CPU layout comes later
        if self.packed.dtype != torch.uint8:
            raise ValueError(f"int4 codes must be packed in uint8, got {self.packed.dtype}")
        cols = 2 * half
        if self.group < 2 or self.group % 2 or cols % self.group:
            raise ValueError(f"group {self.group} does not divide the input width {cols}")
        for name in ("scale", "low"):
            t = getattr(self, name)
            if tuple(t.shape) != (out, cols // self.group):
                raise ValueError(
                    f"int4 {name} has shape {tuple(t.shape)}, expected {(out, cols // self.group)}"
                )
            setattr(self, name, t.float())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scale.shape[0], self.scale.shape[1] * self.group))

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def stored(self) -> torch.Tensor:
        """The codes in the stored layout ([out, in // 2], even input in the low nibble)."""
        if self.packed is not None:
            return self.packed
        if self._tiled is not None:
            return pack_codes(untile_codes(self._tiled[0], *self.shape))
        return pack_codes(_from_cpu_layout(self._cpu[0], *self.shape))

    @property
    def nbytes(self) -> int:
        """What a matmul reads: the codes and a bfloat16 (scale, zero) per group, as a GGUF's
        Q4_1 block holds them (the float32 copies are for exact dequantization)."""
        return self.shape.numel() // 2 + 4 * self.scale.numel()

    def codes(self) -> torch.Tensor:
        """q as uint8 [out, in]."""
        p = self.stored()
        return torch.stack([p & 15, p >> 4], dim=-1).view(p.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, cols = self.shape
        q = self.codes().float().view(out, cols // self.group, self.group)
        w = q * self.scale[..., None] + self.low[..., None]
        return w.view(out, cols).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.flatten()
        if self.packed is None and self._tiled is not None:
            # only the looked-up rows out of their tiles, not the whole table
            cols = self.shape[1]
            tiles = self._tiled[0].view(-1, cols // 32, 4, 16, 4)[flat // 16]  # n, b, j, r, k
            picked = tiles[torch.arange(len(flat)), :, :, flat % 16]  # n, b, j, k
            q = torch.stack([picked & 15, picked >> 4], dim=2).view(len(flat), cols)
            stored = pack_codes(q)
        else:
            stored = self.stored()[flat]
        part = Int4Weight(stored, self.scale[flat], self.low[flat], self.group)
        return part.dequantize(dtype).view(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32:
            if self.tiled_kernel_fits():
                tiles, scale, low = self.tiled_layout()
                y = cpu_quant.int4_tiled_matmul(
                    x.contiguous(), tiles, scale, low, self.group, self.shape[0]
                )
                return y if bias is None else y + bias
        if x.device.type == "cpu" and x.dim() == 2 and self._cpu_kernel_fits():
            packed, scale_zero = self._cpu_layout()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), packed, self.group, scale_zero
            ).to(x.dtype)
            return y if bias is None else y + bias
        if x.is_cuda and x.dim() == 2:
            from engine.kernels.quant_matmul import w4a16_matmul

            y = w4a16_matmul(x, self.stored(), self.scale, self.low, self.group)
            return y if bias is None else y + bias
        return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)

    def tiled_kernel_fits(self) -> bool:
        """Whether float32 CPU activations go to our row-tiled kernel (tiled_layout): where it
        is built with AVX512-VNNI (measured faster than torch's at every row count), or for
        the shapes torch's kernel does not take (rows not in 16s, groups under 32)."""
        if self._tiled is not None:
            return True
        if self._cpu is not None or self.device.type != "cpu":
            return False  # torch's layout, once made, holds the only copy of the codes
        if not (cpu_quant.fits(self.shape[1], self.group, "int4") and cpu_quant.available()):
            return False
        return cpu_quant.isa() == "avx512-vnni" or not self._cpu_kernel_fits()

    def tiled_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tiled is None:
            scale, low = self._scales_for_kernel()
            self._tiled = tile_codes(self.codes(), scale, low, self.group)
            self.packed = None  # one copy of the codes in memory, the one the kernel reads
        return self._tiled

    def _scales_for_kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        # float16 halves the bytes the scales add (8 -> 4 per group) where it changes nothing:
        # a GGUF's Q4_0/Q4_1 scales are float16 to begin with. Q4_K's products of two scales,
        # or our own float32 ones, stay float32.
        if self._kernel_scales is None:
            half = self.scale.half(), self.low.half()
            exact = all(torch.equal(h.float(), f) for h, f in zip(half, (self.scale, self.low)))
            self._kernel_scales = half if exact else (self.scale, self.low)
        return self._kernel_scales

    def _cpu_kernel_fits(self) -> bool:
        # The kernel's own constraints: rows in blocks of 16, groups of 32 or more.
        return self._tiled is None and self.shape[0] % 16 == 0 and self.group >= 32

    def _cpu_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cpu is None:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                self.codes().to(torch.int32), 1
            )
            zero = self.low + 8 * self.scale
            scale_zero = torch.stack([self.scale.t(), zero.t()], dim=-1)
            self._cpu = packed, scale_zero.contiguous().to(torch.bfloat16)
            self.packed = None  # one copy of the codes in memory, the one the kernel reads
        return self._cpu

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(
            self.stored().to(device), self.scale.to(device), self.low.to(device), self.group
        )

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stacked along the output dimension (q|k|v, gate|up)."""
        groups = {p.group for p in parts}
        if len(groups) != 1:
            raise ValueError(f"cannot stack int4 weights with groups {sorted(groups)}")
        return Int4Weight(
            torch.cat([p.stored() for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.low for p in parts]),
            groups.pop(),
        )

    def slice(self, dim: int, start: int, stop: int) -> Int4Weight:
        """A tensor-parallel shard: rows, or columns on group boundaries."""
        if dim == 0:
            rows = slice(start, stop)
            return Int4Weight(self.stored()[rows].contiguous(), self.scale[rows], self.low[rows],
                              self.group)  # fmt: skip
        if start % self.group or stop % self.group:
            raise ValueError(
                f"int4 columns {start}:{stop} do not fall on the weight's {self.group}-wide groups"
            )
        g = slice(start // self.group, stop // self.group)
        return Int4Weight(
            self.stored()[:, start // 2 : stop // 2].contiguous(),
            self.scale[:, g].contiguous(),
            self.low[:, g].contiguous(),
            self.group,
        )


def _from_cpu_layout(cpu: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] codes back from torch's blocked CPU layout (rarely needed: to save or
    dequantize a weight that has run). The layout is a permutation of nibbles that torch does
    not document, so it is read off the conversion itself: each hexadecimal digit of every
    element's index goes through it once, and the digits at a nibble spell whose code it is."""
    n = rows * cols
    index = torch.arange(n, dtype=torch.int64)
    source = torch.zeros(n, dtype=torch.int64)
    for digit in range(max(1, math.ceil(math.log(n, 16)))):
        plane = ((index >> (4 * digit)) & 15).to(torch.int32).view(rows, cols)
        moved = torch.ops.aten._convert_weight_to_int4pack_for_cpu(plane, 1).reshape(-1)
        nibbles = torch.stack([moved & 15, moved >> 4], dim=-1).reshape(-1)
        source |= nibbles.to(torch.int64) << (4 * digit)
    flat = cpu.reshape(-1)
    codes = torch.empty(n, dtype=torch.uint8)
    codes[source] = torch.stack([flat & 15, flat >> 4], dim=-1).reshape(-1)
    return codes.view(rows, cols)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] codes in [0, 15] -> [out, in // 2], the even input in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    """Asymmetric round-to-nearest per group (the Q4_1 scheme): the group's range [min, max]
    maps onto the 16 codes."""
    out, cols = w.shape
    if cols % group:
        raise ValueError(f"int4 group {group} does not divide the input width {cols}")
    g = w.float().view(out, cols // group, group)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp_(0, 15)
    return Int4Weight(pack_codes(q.view(out, cols)), scale, low, group)


def tile_codes(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-tiled layout of engine/kernels/cpu_quant_matmul.c's ns_int4_tiled_matmul from
    codes uint8 [N, K] in [0, 15] and scale, low [N, K / group]: tiles uint8 [T, K / 32 * 256]
    (T = ceil(N / 16), rows past N zero), scale and low [T, K / group, 16]. Byte (j, r, k) of
    tile t, block b: row 16t + r's inputs 32b + 4j + k (low nibble) and 32b + 16 + 4j + k
    (high)."""
    n, k = codes.shape
    tiles = -(-n // 16)
    pad = tiles * 16 - n
    q = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    q = q.view(tiles, 16, k // 32, 2, 4, 4)  # t, r, b, half, j, k
    byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # t, r, b, j, k
    packed = byte.permute(0, 2, 3, 1, 4).contiguous().view(tiles, -1)  # t, b, j, r, k

    def per_tile(s: torch.Tensor) -> torch.Tensor:
        s = torch.nn.functional.pad(s, (0, 0, 0, pad))
        return s.view(tiles, 16, k // group).transpose(1, 2).contiguous()

    return packed, per_tile(scale), per_tile(low)


def untile_codes(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """uint8 [rows, cols] codes back from tile_codes' layout."""
    t = tiles.view(tiles.shape[0], cols // 32, 4, 16, 4)  # t, b, j, r, k
    q = torch.stack([t & 15, t >> 4], dim=2)  # t, b, half, j, r, k
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, cols)  # t, r, b, half, j, k
    return q[:rows].contiguous()
