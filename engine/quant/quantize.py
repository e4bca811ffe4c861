"""A float model's projections quantized in place, at load (`--quantization` on a float
checkpoint): every layer's fused q|k|v, o, gate|up and down; the LM head only when asked (its
rows are what sampling reads, and it is the embedding table when they are tied)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.quant.fp8 import Fp8Weight, quantize_fp8
from engine.quant.int4 import Int4Weight, quantize_int4
from engine.quant.int8 import Int8Weight, quantize_int8

QuantizedWeight = Int8Weight | Int4Weight | Fp8Weight
METHODS = ("int8", "int4", "fp8")
LAYER_WEIGHTS = ("qkv", "o_proj", "gate_up", "down")


def quantize_weight(
    w: torch.Tensor, method: str, group: int = 32, name: str = ""
) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        if w.shape[1] % group:
            raise ModelLoadError(
                f"int4 groups of {group} do not divide {name or 'a weight'}'s input width "
                f"{w.shape[1]}; choose a group size that does (32, 64 or 128)"
            )
        return quantize_int4(w, group)
    if method == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"unknown quantization {method!r}; choose {', '.join(METHODS)}")


def quantize_model(model, method: str, group: int = 32, lm_head: bool = False) -> None:
    """Replaces the model's float projections with quantized ones (already quantized ones stay)."""
    for i, layer in enumerate(model.layers):
        for attr in LAYER_WEIGHTS:
            w = getattr(layer, attr)
            if isinstance(w, torch.Tensor):
                name = f"layer {i} {attr}"
                setattr(layer, attr, quantize_weight(w, method, group, name))
    if lm_head and isinstance(model.lm_head, torch.Tensor):
        head = quantize_weight(model.lm_head, method, group, "the LM head")
        if model.lm_head is model.embed:
            model.embed = head  # tied: one table, looked up row by row
        model.lm_head = head


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(src: Path, dst: Path, method: str, group: int = 32, lm_head: bool = False):
    """`nightshift model quantize`: SRC's projections (and with lm_head its output projection)
    quantized into a new folder DST. From the default model's folder, int4 in groups of 32
    takes the GGUF's own blocks (its Q8_0 embedding table too): exact, where quantizing their
    float32 dequantization again would round a second time."""
    from engine.models.loader import _gguf_blocks_source
    from engine.models.model_config import load_model_config
    from engine.models.weights import load_weights
    from engine.quant.checkpoint import quantization_config, save_quantized
    from engine.quant.gguf_blocks import load_gguf_weights

    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose {', '.join(METHODS)}")
    config = load_model_config(src)
    if quantization_config(src) is not None:
        raise ModelLoadError(f"{src} is quantized already; quantize its float source instead")
    gguf = _gguf_blocks_source(src, method, group)
    if gguf is not None:
        weights, _ = load_gguf_weights(gguf, torch.float32)
        source = f"{gguf.name} (its blocks as they are)"
    else:
        weights, _ = load_weights(src, torch.float32)
        source = f"{src.name} quantized round-to-nearest"
        for name in list(weights):
            module = name.rsplit(".", 2)
            if len(module) == 3 and module[1] in PROJECTIONS and module[2] == "weight":
                weights[name] = quantize_weight(weights[name], method, group, name)
        if lm_head:
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            if head not in weights:
                head = "model.embed_tokens.weight"
            weights[head] = quantize_weight(weights[head], method, group, "the LM head")
    save_quantized(weights, src, dst, method, group, source)


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads (every projection and the LM head)."""
    total = 0
    for layer in model.layers:
        for attr in LAYER_WEIGHTS:
            w = getattr(layer, attr)
            total += w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
    head = model.lm_head
    total += (
        head.nbytes if not isinstance(head, torch.Tensor) else head.numel() * head.element_size()
    )
    return total
