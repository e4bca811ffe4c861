"""The whole-step decode kernel (cpu_decode.c) for a Llama-family model on the CPU: one call runs
every layer of a step in which each request adds one token.

`DecodeStep.of(model)` says whether a model can use it, and builds it: float32 activations on
the CPU, one rank, not the Triton backend (on the CPU only its interpreter, in tests), every
projection int4 in the row-tiled layout our AVX512-VNNI kernel reads
(engine/quant/int4.py), no per-head q/k norms, no sliding window. `run` then also wants a step
of decodes only and float32 K/V pools; anything else is the Python path's (engine/models/
llama.py), as is everything when NIGHTSHIFT_CPU_DECODE=0 or no compiler is found.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.kernels import cpu_build, cpu_quant
from engine.quant.int4 import Int4Weight

if TYPE_CHECKING:
    from engine.attention.kv_quant import LayerKVCache
    from engine.attention.metadata import AttentionMetadata
    from engine.models.llama import LlamaModel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Int4(ctypes.Structure):
    _fields_ = [("tiles", _ptr), ("scale", _ptr), ("low", _ptr), ("n", _i64), ("k", _i64),
                ("group", _i64), ("f16", _i64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv_bias", _ptr), ("qkv", _Int4),
                ("o", _Int4), ("gate_up", _Int4), ("down", _Int4), ("k_pool", _ptr),
                ("v_pool", _ptr)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("intermediate", _i64),
                ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("block_size", _i64), ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", _ptr),
                ("cos_sin", _ptr)]  # fmt: skip


class DecodeStep:
    """One model's weights as cpu_decode.c reads them (the tensors stay the model's; this holds
    pointers to them and the model keeps them alive)."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaModel) -> None:
        self._fn = lib.ns_llama_decode
        self._fn.argtypes = [ctypes.POINTER(_Model), _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                             ctypes.c_int]  # fmt: skip
        self._fn.restype = ctypes.c_int
        cfg = model.config
        self._layers = (_Layer * cfg.num_layers)()
        for layer, w in zip(self._layers, model.layers):
            layer.input_norm = w.input_norm.data_ptr()
            layer.post_norm = w.post_norm.data_ptr()
            layer.qkv_bias = w.qkv_bias.data_ptr() if w.qkv_bias is not None else None
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, _int4(getattr(w, "o_proj" if name == "o" else name)))
        self._model = _Model(
            num_layers=cfg.num_layers, hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size, num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads, head_dim=cfg.head_dim, block_size=0,
            eps=cfg.rms_norm_eps, attn_scale=model.scale, layers=self._layers,
            final_norm=model.norm.data_ptr(), cos_sin=model.cos_sin.data_ptr(),
        )  # fmt: skip
        self._pools: tuple[int, ...] = ()

    @staticmethod
    def of(model: LlamaModel) -> DecodeStep | None:
        """The kernel for `model`, or None where it does not apply (see the module's text)."""
        cfg = model.config
        if (
            os.environ.get("NIGHTSHIFT_CPU_DECODE", "1") == "0"
            or model.device.type != "cpu"
            or model.dtype != torch.float32
            or model.tp.size != 1
            or model.backend.name == "triton"  # asked for on the CPU: Triton's interpreter, tests
            or cfg.qk_norm
            or cfg.sliding_window
            or cfg.head_dim > 512
            or cpu_quant.isa() != "avx512-vnni"
        ):
            return None
        names = ("qkv", "o_proj", "gate_up", "down")
        weights = [getattr(layer, n) for layer in model.layers for n in names]
        if not all(isinstance(w, Int4Weight) and w.tiled_kernel_fits() for w in weights):
            return None
        lib = _loaded.get()
        return DecodeStep(lib, model) if lib is not None else None

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The step's final hidden states [R, hidden] from its token embeddings, or None when
        the step is not one this kernel runs (then nothing was written)."""
        if meta.num_decodes != meta.num_reqs or hidden.shape[0] != meta.num_reqs:
            return None
        first = kv_caches[0]
        if first.scales is not None or first.k.dtype != torch.float32:
            return None
        pools = tuple(p.data_ptr() for c in kv_caches for p in (c.k, c.v))
        if pools != self._pools:
            for layer, cache in zip(self._layers, kv_caches):
                if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
                    return None
                layer.k_pool, layer.v_pool = cache.k.data_ptr(), cache.v.data_ptr()
            self._model.block_size = first.k.shape[1]
            self._pools = pools
        out = hidden.contiguous().clone()
        tables = meta.block_tables.contiguous()
        positions, slots, lens = (
            t.contiguous() for t in (positions, meta.slot_mapping, meta.seq_lens)
        )
        rc = self._fn(
            ctypes.byref(self._model), out.shape[0], out.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("decode step: no memory for its activations")
        if rc:
            raise ValueError(f"decode step: shapes the CPU kernels do not take (rc {rc})")
        return out


def _int4(w: Int4Weight) -> _Int4:
    tiles, scale, low = w.tiled_layout()
    n, k = w.shape
    f16 = int(scale.dtype == torch.float16)
    return _Int4(tiles.data_ptr(), scale.data_ptr(), low.data_ptr(), n, k, w.group, f16)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("NIGHTSHIFT_CPU_DECODE", "1") == "0":
        return None
    try:
        return cpu_build.build(SOURCE, cpu_build.march())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("no whole-step CPU decode kernel (%s): decoding layer by layer", e)
        return None


_loaded = cpu_build.LoadOnce(_load)
