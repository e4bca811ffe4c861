"""Loads safetensors checkpoints (one file or shards with an index) into a name -> tensor dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelLoadError
from engine.models.sharding import ShardPlan


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


def load_weights(
    model_dir: Path, dtype: torch.dtype, plan: ShardPlan | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """(name -> tensor, name -> the checkpoint's full shape). With a tensor-parallel `plan`,
    only this rank's slice of each split tensor is read from disk (safetensors reads slices
    without loading the rest), so a rank holds 1/size of the split weights."""
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    shapes[name] = tuple(part.get_shape())
                    tensor = _read(part, name, shapes[name], plan)
                    weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights {path}: {e}") from e
    return weights, shapes


def _read(part, name: str, shape: tuple[int, ...], plan: ShardPlan | None) -> torch.Tensor:
    rule = plan.slice_for(name) if plan is not None else None
    if rule is None or len(shape) <= rule[0]:
        return part[:]
    dim, start, stop = rule
    start = min(start, shape[dim])
    stop = min(stop, shape[dim])
    # A column slice comes back as a strided view of the whole tensor: copied, so the rank keeps
    # only its slice (and the matmul kernels get the dense layout they are fast on; a strided
    # weight ran oneDNN's linear 300x slower).
    tensor = (part[start:stop] if dim == 0 else part[:, start:stop]).contiguous()
    rows = plan.padded_rows(name)
    if rows is not None and tensor.shape[0] < rows:  # the vocabulary's last shard
        pad = torch.zeros((rows - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
        tensor = torch.cat([tensor, pad])
    return tensor
