"""A quantized model folder: what `nightshift model quantize SRC DST` writes and the loader reads.

The folder is the source's, with model.safetensors holding every quantized projection as
`<module>.weight` (int8 codes; int4 codes packed two a byte, the even input in the low nibble;
fp8 e4m3 codes) beside `<module>.weight_scale` and, for int4, `<module>.weight_low` (float32,
one per group and output row: w = scale q + low), norms and float tensors as they were, and
config.json's `quantization_config`:

    {"quant_method": "nightshift", "format": "int4", "group_size": 32, "lm_head": false,
     "source": "...", "layout": {"model.layers.0.self_attn.q_proj.weight": "int4", ...}}

`layout` names each tensor's format: a GGUF source gives mixed ones (Q4_1 projections as int4,
its Q8_0 embedding table as int8 in groups of 32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.models.sharding import ShardPlan
from engine.models.weights import _read
from engine.quant.fp8 import Fp8Weight
from engine.quant.int4 import Int4Weight
from engine.quant.int8 import Int8Weight

QUANT_METHOD = "nightshift"
FORMATS = {Int8Weight: "int8", Int4Weight: "int4", Fp8Weight: "fp8"}


def quantization_config(model_dir: Path) -> dict | None:
    config = json.loads((model_dir / "config.json").read_text())
    q = config.get("quantization_config")
    if q is None:
        return None
    if q.get("quant_method") != QUANT_METHOD or q.get("format") not in ("int8", "int4", "fp8"):
        raise ModelLoadError(
            f"{model_dir}: quantization_config {json.dumps(q)[:200]} is not one this engine "
            f"reads (quant_method {QUANT_METHOD!r}, format int8, int4 or fp8)"
        )
    return q


def save_quantized(weights: dict, src: Path, dst: Path, fmt: str, group: int, source: str) -> None:
    """weights: HF name -> tensor or quantized weight. Everything but the weights is copied."""
    if dst.exists() and any(dst.iterdir()):
        raise ModelLoadError(f"{dst} exists and is not empty; choose a new folder")
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, str] = {}
    for name, w in weights.items():
        if isinstance(w, torch.Tensor):
            tensors[name] = w.contiguous()
            continue
        layout[name] = FORMATS[type(w)]
        if isinstance(w, Int4Weight):
            tensors[name], tensors[name + "_low"] = w.stored(), w.low
        else:
            tensors[name] = w.q
        tensors[name + "_scale"] = w.scale
        if not isinstance(w, Fp8Weight):
            tensors[name + "_group"] = torch.tensor([w.group], dtype=torch.int32)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix == ".safetensors" or item.name.startswith(".") or item.is_dir():
            continue
        if item.name != "model.safetensors.index.json":
            shutil.copy2(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "group_size": group,
        "lm_head": "lm_head.weight" in layout
        or ("model.embed_tokens.weight" in layout and config.get("tie_word_embeddings", False)),
        "source": source,
        "layout": layout,
    }
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_quantized(model_dir: Path, qconfig: dict, dtype: torch.dtype, plan: ShardPlan | None):
    """(HF name -> tensor or quantized weight, HF name -> logical shape), this rank's slices."""
    layout: dict[str, str] = qconfig.get("layout", {})
    path = model_dir / "model.safetensors"
    raw: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                raw[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read weights {path}: {e}") from e
    weights, shapes = {}, {}
    for name, fmt in layout.items():
        try:
            w = _weight(raw, name, fmt)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{path}: quantized tensor {name!r} is malformed: {e}") from e
        shapes[name] = tuple(w.shape)
        rule = plan.slice_for(name) if plan is not None else None
        if rule is not None:
            dim, start, stop = rule
            w = w.slice(dim, start, min(stop, w.shape[dim]))
            rows = plan.padded_rows(name)
            if rows is not None and w.shape[0] < rows:
                raise ModelLoadError(
                    f"{name}: a quantized vocabulary of {shapes[name][0]} rows does not split "
                    f"evenly over {plan.size} ranks"
                )
        weights[name] = w
    companions = {n + s for n in layout for s in ("_scale", "_low", "_group")}
    for name, t in raw.items():
        if name in layout or name in companions:
            continue
        shapes[name] = tuple(t.shape)
        t = _read(t, name, shapes[name], plan)  # a tensor slices as a safetensors part does
        weights[name] = t.to(dtype) if t.is_floating_point() else t
    return weights, shapes


def _weight(raw: dict[str, torch.Tensor], name: str, fmt: str):
    scale = raw[name + "_scale"]
    if fmt == "fp8":
        return Fp8Weight(raw[name], scale)
    group = int(raw[name + "_group"][0])
    if fmt == "int8":
        return Int8Weight(raw[name], scale, group)
    if fmt == "int4":
        return Int4Weight(raw[name], scale, raw[name + "_low"], group)
    raise ValueError(f"unknown format {fmt!r}")
