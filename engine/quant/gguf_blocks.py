"""A GGUF file's quantized blocks loaded into our layouts as they are, without a float round trip:
the engine then reads the bytes llama.cpp reads.

    Q4_0  d, 32 codes          w = d (q - 8)          -> Int4Weight, group 32, low = -8 d
    Q4_1  d, m, 32 codes       w = d q + m            -> Int4Weight, group 32, low = m
    Q4_K  256 = 8 x 32: d, dmin, 6-bit sc and mn per 32
                               w = d sc q - dmin mn   -> Int4Weight, group 32
    Q8_0  d, 32 int8 codes     w = d q                -> Int8Weight, group 32
    Q6_K  256 = 16 x 16: d, int8 sc per 16, 6-bit q
                               w = d sc (q - 32)      -> Int8Weight, group 16
    F32, F16, BF16                                    -> float tensors

Each formula is evaluated in float32 the way the `gguf` package's dequantization evaluates it
(products of fp16 scales and small integers are exact in float32), so our dequantization is
bit-identical to theirs (tests/engine/test_quant_gguf.py). The codes are only reordered:
GGUF puts a block's first 16 codes in the low nibbles and the next 16 in the high ones, our
int4 layout pairs neighbours. Other block types (Q5_*, Q2_K, Q3_K, IQ*) have no integer layout
here: loading them names the tensor and its type."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from engine.errors import ModelLoadError
from engine.gguf_convert import _hf_tensor_name, _unpermute_rope
from engine.models.sharding import ShardPlan
from engine.quant.int4 import Int4Weight, pack_codes
from engine.quant.int8 import Int8Weight

QK_K = 256
INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
INT8_TYPES = frozenset({T.Q8_0, T.Q6_K})
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] codes in GGUF's order (low nibbles, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    d = _f16(blocks[:, :2]).view(-1)
    return _nibbles(blocks[:, 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    return _nibbles(blocks[:, 4:]), _f16(blocks[:, :2]).view(-1), _f16(blocks[:, 2:4]).view(-1)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # [n, 1]
    s = blocks[:, 4:16].reshape(n, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    scale = d * torch.from_numpy(sc.astype(np.float32))  # [n, 8]
    low = -(dmin * torch.from_numpy(mn.astype(np.float32)))
    # 128 bytes: 4 x 32; each 32 holds two sub-blocks, the first in the low nibbles.
    qs = blocks[:, 16:].reshape(n, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, 32)
    return codes, scale.reshape(-1), low.reshape(-1)


def _q8_0(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    return torch.from_numpy(q.copy()), _f16(blocks[:, :2]).view(-1)


def _q6_k(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, 8, 32)
    high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n * 16, 16)
    return torch.from_numpy(q), (d * torch.from_numpy(sc)).reshape(-1)


def tensor_weight(data: np.ndarray, qtype: T, shape: tuple[int, int], name: str):
    """One GGUF tensor (its raw [rows, bytes] data) as an Int4Weight, Int8Weight or float32."""
    rows, cols = shape
    if qtype in FLOAT_TYPES:
        from gguf.quants import dequantize

        return torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32)).view(shape)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    if qtype in INT4_TYPES:
        per = QK_K if qtype == T.Q4_K else 32
        size = {T.Q4_0: 18, T.Q4_1: 20, T.Q4_K: 144}[qtype]
        blocks = raw.reshape(rows * cols // per, size)
        codes, scale, low = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}[qtype](blocks)
        codes = torch.from_numpy(np.ascontiguousarray(codes)).view(rows, cols)
        return Int4Weight(
            pack_codes(codes), scale.view(rows, cols // 32), low.view(rows, cols // 32), 32
        )
    if qtype == T.Q8_0:
        q, scale = _q8_0(raw.reshape(rows * cols // 32, 34))
        return Int8Weight(q.view(rows, cols), scale.view(rows, cols // 32), 32)
    if qtype == T.Q6_K:
        q, scale = _q6_k(raw.reshape(rows * cols // QK_K, 210))
        return Int8Weight(q.view(rows, cols), scale.view(rows, cols // 16), 16)
    raise ModelLoadError(
        f"GGUF tensor {name!r} is {qtype.name}, which has no integer layout here (supported: "
        f"{', '.join(t.name for t in sorted(INT4_TYPES | INT8_TYPES | FLOAT_TYPES))})"
    )


def gguf_types(path: Path) -> dict[str, str]:
    """HF tensor name -> the GGUF block type it is stored in."""
    return {_hf_tensor_name(t.name): t.tensor_type.name for t in _reader(path).tensors}


def _reader(path: Path) -> GGUFReader:
    """The file parsed once for a load that asks twice (gguf_types, then load_gguf_weights):
    the reader parses every metadata field, the default model's 49k-word vocabulary included,
    about 2 s each time. Keyed by the file's identity, so a replaced file is read again."""
    stat = Path(path).stat()
    return _parsed(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)


def load_gguf_weights(path: Path, dtype: torch.dtype, plan: ShardPlan | None = None):
    """(HF name -> tensor or quantized weight, HF name -> full shape) from a llama GGUF, with
    the Q/K rows put back in HF's rotary order (llama.cpp's converter interleaves them) and,
    with a tensor-parallel plan, this rank's slice."""
    reader = _reader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    n_head = int(fields["llama.attention.head_count"])
    n_kv = int(fields.get("llama.attention.head_count_kv", n_head))
    weights, shapes = {}, {}
    for t in reader.tensors:
        name = _hf_tensor_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest axis first
        if len(shape) == 1:
            w = tensor_weight(t.data, t.tensor_type, (1, shape[0]), name).view(-1)
        else:
            w = tensor_weight(t.data, t.tensor_type, shape, name)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if name.endswith("q_proj.weight") else n_kv
            order = _unpermute_rope(np.arange(shape[0]), heads)
            w = _take_rows(w, torch.from_numpy(np.ascontiguousarray(order)))
        shapes[name] = shape
        weights[name] = _shard(w, name, shape, plan, dtype)
    return weights, shapes


def _take_rows(w, order: torch.Tensor):
    if isinstance(w, torch.Tensor):
        return w[order].contiguous()
    if isinstance(w, Int4Weight):
        return Int4Weight(w.stored()[order].contiguous(), w.scale[order], w.low[order], w.group)
    return Int8Weight(w.q[order].contiguous(), w.scale[order], w.group)


def _shard(w, name: str, shape: tuple[int, ...], plan: ShardPlan | None, dtype: torch.dtype):
    rule = plan.slice_for(name) if plan is not None else None
    if isinstance(w, torch.Tensor):
        w = w.to(dtype)
        if rule is None or len(shape) <= rule[0]:
            return w
        dim, start, stop = rule
        w = w.narrow(dim, start, min(stop, shape[dim]) - start).contiguous()
    elif rule is not None:
        dim, start, stop = rule
        w = w.slice(dim, start, min(stop, shape[dim]))
    rows = plan.padded_rows(name) if plan is not None else None
    if rows is not None and w.shape[0] < rows:
        raise ModelLoadError(
            f"{name}: the vocabulary ({shape[0]}) does not split evenly over "
            f"{plan.size} ranks; a GGUF's quantized table cannot be padded"
        )
    return w
