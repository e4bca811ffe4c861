"""Loads safetensors checkpoints (one file or shards with an index) into a name -> tensor dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.errors import ModelLoadError


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from e
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    raise ModelLoadError(f"model folder {model_dir} has no *.safetensors weights")


def load_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights {path}: {e}") from e
        for name, tensor in tensors.items():
            weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights
