"""Reads a Hugging Face config.json into the few numbers the engine's decoder needs.

Every family we support is a Llama-style pre-norm decoder; they differ only in flags (qkv bias for
Qwen2, per-head q/k RMSNorm for Qwen3, sliding window for Mistral), which live here so that the
model code has no per-family branches beyond those flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

# architecture name -> (qkv bias default, q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str  # the checkpoint's dtype name, e.g. "float32", "bfloat16"
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, per byte of element size (multiply by itemsize)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model folder {model_dir} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    return parse_model_config(raw, source=str(path), eos_extra=_generation_eos(model_dir))


def parse_model_config(raw: dict, source: str, eos_extra: tuple[int, ...] = ()) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]

    def need(key: str) -> int | float:
        if key not in raw:
            raise ModelLoadError(f"{source}: missing required field {key!r}")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw, source),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=tuple(dict.fromkeys(eos_ids + eos_extra)),
    )


def _parse_rope(raw: dict, source: str) -> RopeConfig:
    # Transformers 5 keeps theta and scaling under "rope_parameters"; older files use "rope_theta"
    # and "rope_scaling". Read both, newer first.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ModelLoadError(
        f"{source}: unsupported rope scaling {kind!r} (supported: default, llama3)"
    )


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return ()
    return tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
