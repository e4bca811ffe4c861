"""What every tensor-parallel rank must agree on before they compute together.

Ranks of an env:// launch are started separately, each with its own command line and model
folder. Two ranks with different checkpoints of one architecture would serve wrong text without
an error, a different vocabulary or context length would crash the group at the first request:
so each rank publishes its identity when it joins, and every rank compares the others' with its
own before any weight is loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# A checkpoint is recognised by its config and weight files' names and sizes and by samples of
# their bytes: enough to tell two checkpoints (or fine-tunes) of one architecture apart, whose
# headers and sizes are equal but whose tensors differ throughout, without reading 100s of GB.
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
WHOLE_FILE_BYTES = 4 * 1024 * 1024  # smaller files are hashed whole
MODEL_FILES = ("config.json",)
WEIGHT_GLOB = "*.safetensors"

# The option that sets each field, for the message.
OPTIONS = {
    "model": "--model",
    "device": "--device",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "block_size": "--block-size",
    "kernels": "--attention-backend",
    "kv_cache_dtype": "--kv-cache-dtype",
}


@dataclass(frozen=True, slots=True)
class RankIdentity:
    model: str  # fingerprint of the checkpoint's files
    device: str  # cpu or cuda: the groups' backend follows it
    dtype: str
    max_model_len: int
    block_size: int
    kernels: str
    model_dir: str  # not compared (each machine has its own path): named in the message
    kv_cache_dtype: str = "auto"  # every rank's pool holds its heads in the same format

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankIdentity:
        return cls(**json.loads(text))

    def differences(self, other: RankIdentity) -> list[str]:
        return [
            f.name
            for f in fields(self)
            if f.name != "model_dir" and getattr(self, f.name) != getattr(other, f.name)
        ]


def rank_identity(config, placement) -> RankIdentity:
    return RankIdentity(
        model=fingerprint(Path(placement.model_dir)),
        device=placement.device.type,
        dtype=str(placement.dtype).removeprefix("torch."),
        max_model_len=placement.max_model_len,
        block_size=config.block_size,
        kernels=placement.kernels,
        model_dir=str(placement.model_dir),
        kv_cache_dtype=config.kv_cache_dtype,
    )


def fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256()
    paths = [model_dir / name for name in MODEL_FILES if (model_dir / name).is_file()]
    paths += sorted(model_dir.glob(WEIGHT_GLOB))
    for path in paths:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= WHOLE_FILE_BYTES:
                digest.update(f.read())
                continue
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def mismatch(rank: int, mine: RankIdentity, other_rank: int, theirs: RankIdentity) -> str | None:
    """One line naming what differs between this rank's identity and another's, or None."""
    fields_ = mine.differences(theirs)
    if not fields_:
        return None
    parts = []
    for name in fields_:
        if name == "model":
            parts.append(
                f"the model ({mine.model_dir} here, {theirs.model_dir} on rank {other_rank}: "
                "different checkpoint files)"
            )
        else:
            parts.append(
                f"{name} ({getattr(mine, name)} here, {getattr(theirs, name)} on rank {other_rank})"
            )
    options = ", ".join(OPTIONS[name] for name in fields_)
    return (
        f"tensor-parallel rank {rank} was started differently from rank {other_rank}: "
        f"{'; '.join(parts)}; every rank needs the same model and the same {options}"
    )
