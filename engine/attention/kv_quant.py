"""The KV pool's element format (`--kv-cache-dtype auto|fp8|int8`), a layer's pool tensors, and
the torch reference of quantize-on-store / dequantize-on-read.

auto keeps K/V in the model's dtype (float32 on CPU, bf16 on a GPU). fp8 (float8_e4m3fn) and int8
store one byte an element plus one float32 scale per (token, KV head) for K and one for V, beside
the pool: [num_blocks, block_size, Hkv] each, so a block's scales move with its slots (prefix
hits, preemption and draft K/V need nothing more). A token's head row x [D] is stored as
codes = x / s with s = absmax(x) / QMAX (448 for e4m3, the largest finite value; 127 for int8,
rounded half up), and read back as codes * s. Per-token scales need no calibration and follow each
row's own range (RoPE'd keys of some heads are far larger than others); one scale per layer, vLLM's
fp8 default, would need calibrated scales to avoid clipping. Float32 scales cost 4 bytes per head
row (6% of an fp8 row at head_dim 64, 3% at 128) and keep the kernels' arithmetic in fp32; the
block counts of the engine (KVCacheFormat.bytes_per_token) and of the capacity planner
(capacity.memory.kv_bytes_per_token(..., token_scales=True)) include them.

Both backends quantize on store the same way (the Triton kv_write kernel mirrors quantize_kv) and
dequantize on read: the torch backend after its gather (dequantize_kv), the Triton kernels in
their loads (engine/kernels/paged_attention.py: K's scales applied to the logits, V's rows
dequantized in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.config import KV_CACHE_DTYPES

SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # per (token, KV head), for K and again for V
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    name: str  # auto, fp8, int8
    dtype: torch.dtype  # the pool's elements
    qmax: float = 0.0  # the largest code (0: not quantized)

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token over all layers, scales included."""
        per_head = head_dim * self.dtype.itemsize + (SCALE_BYTES if self.quantized else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def describe(self) -> str:
        """For the startup log: the element dtype, and the scales when there are any."""
        name = str(self.dtype).removeprefix("torch.")
        return f"{name} + float32 scale per token and KV head" if self.quantized else name


def kv_cache_format(name: str, model_dtype: torch.dtype) -> KVCacheFormat:
    if name not in KV_CACHE_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"kv_cache_dtype must be one of {choices}, not {name!r}")
    if name == "fp8":
        return KVCacheFormat("fp8", torch.float8_e4m3fn, FP8_MAX)
    if name == "int8":
        return KVCacheFormat("int8", torch.int8, INT8_MAX)
    return KVCacheFormat("auto", model_dtype)


class LayerKVCache(NamedTuple):
    """One layer's pool. A tuple, so code that only passes the caches along (CUDA graphs, the
    draft model) needs no change and `cache[0]` is still the K pool."""

    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, Hkv] float32 (fp8, int8)
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale, self.v_scale


def allocate_layer(
    fmt: KVCacheFormat,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> LayerKVCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.zeros(shape, dtype=fmt.dtype, device=device)
    v = torch.zeros(shape, dtype=fmt.dtype, device=device)
    if not fmt.quantized:
        return LayerKVCache(k, v)
    scale_shape = shape[:3]
    return LayerKVCache(
        k,
        v,
        torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device),
        torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device),
    )


def qmax_of(dtype: torch.dtype) -> float:
    if dtype == torch.float8_e4m3fn:
        return FP8_MAX
    if dtype == torch.int8:
        return INT8_MAX
    raise ValueError(f"no quantized KV format stores {dtype}")


def check_scale_pools(
    pool: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
) -> bool:
    """Whether pool ([num_blocks, block_size, Hkv, D]) holds fp8/int8 codes; raises unless
    kv_scales are given exactly then, as contiguous float32 [num_blocks, block_size, Hkv]."""
    quantized = pool.dtype in (torch.float8_e4m3fn, torch.int8)
    if quantized != (kv_scales is not None):
        raise ValueError(f"a {pool.dtype} KV pool needs scales exactly when it holds fp8/int8")
    for scale in kv_scales or ():
        if scale.shape != pool.shape[:3] or scale.dtype != SCALE_DTYPE or not scale.is_contiguous():
            raise ValueError(
                f"KV scales must be contiguous float32 {tuple(pool.shape[:3])}, got "
                f"{scale.dtype} {tuple(scale.shape)}"
            )
    return quantized


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in dtype, scales [...] float32), one scale per row."""
    qmax = qmax_of(dtype)
    x = x.float()
    scale = x.abs().amax(dim=-1) / qmax
    # An all-zero row keeps scale 0 (it reads back as zeros) and is divided by 1, not 0.
    scaled = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if dtype == torch.int8:
        scaled = torch.floor(scaled + 0.5)  # half up, as the Triton kernel rounds
    return scaled.clamp(-qmax, qmax).to(dtype), scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] and scales [...] -> values [..., D] in dtype. The product is taken in
    float32: a small scale (a row of absmax < 0.03 has one under 6e-5) is subnormal in fp16."""
    if codes.dtype == torch.float8_e4m3fn and codes.device.type == "cpu":
        values = _e4m3_as_scaled_fp16(codes).float()
        scales = scales * _E4M3_FP16_FACTOR
    else:
        values = codes.float()
    # In place: on CPU each fresh tensor of a decode's gathered context (MBs) is new pages to
    # fault in, which cost more than the multiply (measured 2.5x for int8 decode steps).
    values.mul_(scales.unsqueeze(-1))
    return values if dtype == torch.float32 else values.to(dtype)


# _e4m3_as_scaled_fp16's values are the codes' times 2^(7 - 15) (the two exponent biases).
_E4M3_FP16_FACTOR = 256.0


def _e4m3_as_scaled_fp16(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes as float16 values 2^-8 times theirs, by moving bits: torch's CPU
    fp8 -> float32 cast is scalar code (60 dequantizations of [520, 16, 3, 64] codes with their
    scales, 2 threads: the cast 210 ms, a 256-entry table lookup 170, this 45). e4m3 is sign |
    4 exponent bits (bias 7) | 3 mantissa bits; shifted left by 7 into a float16 (bias 15) the
    same bits mean the value times 2^-8, subnormals included (float16 subnormals, which the cast
    to float32 makes normal). The int8 view sign-extends, so the shift also sets bit 14 for a
    negative code; the mask clears it. e4m3fn's NaN (never stored) would read as 480."""
    bits = codes.view(torch.int8).to(torch.int16)
    return bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)


def copyable(pool: torch.Tensor) -> torch.Tensor:
    """The pool as a tensor index_copy_ takes: torch's CPU index_copy_ has no float8 kernel, so
    fp8 pools are written through a uint8 view of the same bytes."""
    return pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
