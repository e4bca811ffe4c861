"""Model facts for capacity planning: the shape numbers of a Llama-style decoder, read from a local
Hugging Face config.json or taken from a built-in catalogue, and the parameter counts they imply.

Every family here (Llama, Mistral, Qwen2, Qwen3, SmolLM2) is a pre-norm decoder with grouped-query
attention and a gated SiLU MLP; they differ only in qkv bias (Qwen2) and per-head q/k RMSNorm
(Qwen3), which is all a parameter count needs to know.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from workload.input_file import BadInputFile, read_json

MAX_SHAPE = 2**31  # a config's shape numbers fit int32, as every framework stores them


class ModelSpecError(ValueError):
    """A model name is unknown, or its config.json lacks what planning needs."""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False  # Qwen2: biases on q, k and v (not o)
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on q and on k
    source: str = ""  # the config.json the facts come from (hub URL or local path)


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


# Facts copied from each model's official config.json on its hub page (the URL in `source`):
# num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, head_dim (or
# hidden_size / num_attention_heads when absent), intermediate_size, vocab_size,
# tie_word_embeddings, max_position_embeddings; qkv bias and q/k norm follow the architecture.
# Base and -Instruct checkpoints share these shapes (Qwen2.5 -Instruct configs list 32768 positions,
# extended to 128K with YaRN; the base configs list 131072, kept here).
# Fields in order: name, layers, hidden, heads, KV heads, head_dim, intermediate, vocab, tied,
# max positions. The comment above each entry gives the parameter count its facts imply.
CATALOGUE: tuple[ModelSpec, ...] = (
    # 8,030,261,248.
    ModelSpec(
        "Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, 131072,
        source=_hub("meta-llama/Llama-3.1-8B"),
    ),
    # 70,553,706,496.
    ModelSpec(
        "Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, False, 131072,
        source=_hub("meta-llama/Llama-3.1-70B"),
    ),
    # 494,032,768 (model card: 0.49B). Tied embeddings, 14 heads of 64.
    ModelSpec(
        "Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151936, True, 32768, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-0.5B"),
    ),
    # 1,543,714,304 (model card: 1.54B). Tied embeddings.
    ModelSpec(
        "Qwen2.5-1.5B", 28, 1536, 12, 2, 128, 8960, 151936, True, 131072, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-1.5B"),
    ),
    # 3,085,938,688 (model card: 3.09B). Tied embeddings.
    ModelSpec(
        "Qwen2.5-3B", 36, 2048, 16, 2, 128, 11008, 151936, True, 32768, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-3B"),
    ),
    # 7,615,616,512 (the model card says 7.61B).
    ModelSpec(
        "Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, 131072, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-7B"),
    ),
    # 14,770,033,664 (model card: 14.7B).
    ModelSpec(
        "Qwen2.5-14B", 48, 5120, 40, 8, 128, 13824, 152064, False, 131072, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-14B"),
    ),
    # 32,763,876,352 (the model card says 32.5B; this is the count the config's shapes give).
    ModelSpec(
        "Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064, False, 131072, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-32B"),
    ),
    # 72,706,203,648 (model card: 72.7B).
    ModelSpec(
        "Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, False, 131072, qkv_bias=True,
        source=_hub("Qwen/Qwen2.5-72B"),
    ),
    # 8,190,735,360 (model card: 8.2B). head_dim is explicit: 32 x 128 = hidden 4096.
    ModelSpec(
        "Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, False, 40960, qk_norm=True,
        source=_hub("Qwen/Qwen3-8B"),
    ),
    # Llama 3 and 3.3 have the shapes of 3.1 (Llama 3: 8192 positions, before 3.1's RoPE scaling).
    ModelSpec(
        "Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, 8192,
        source=_hub("meta-llama/Meta-Llama-3-8B"),
    ),
    ModelSpec(
        "Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, False, 8192,
        source=_hub("meta-llama/Meta-Llama-3-70B"),
    ),
    ModelSpec(
        "Llama-3.3-70B", 80, 8192, 64, 8, 128, 28672, 128256, False, 131072,
        source=_hub("meta-llama/Llama-3.3-70B-Instruct"),
    ),
    # 6,738,415,616. Multi-head attention (32 KV heads), 4096 positions.
    ModelSpec(
        "Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000, False, 4096,
        source=_hub("meta-llama/Llama-2-7b-hf"),
    ),
    # 14,768,307,200 (model card: 14.8B).
    ModelSpec(
        "Qwen3-14B", 40, 5120, 40, 8, 128, 17408, 151936, False, 40960, qk_norm=True,
        source=_hub("Qwen/Qwen3-14B"),
    ),
    # 32,762,123,264 (model card: 32.8B). 64 query heads of 128: q is wider than hidden 5120.
    ModelSpec(
        "Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, False, 40960, qk_norm=True,
        source=_hub("Qwen/Qwen3-32B"),
    ),
    # 7,248,023,552. v0.3 extends the vocabulary of v0.1/v0.2 from 32000 to 32768.
    ModelSpec(
        "Mistral-7B-v0.3", 32, 4096, 32, 8, 128, 14336, 32768, False, 32768,
        source=_hub("mistralai/Mistral-7B-v0.3"),
    ),
    # Our default model. 134,515,008, equal to the tensors of the converted checkpoint.
    ModelSpec(
        "SmolLM2-135M-Instruct", 30, 576, 9, 3, 64, 1536, 49152, True, 8192,
        source=_hub("HuggingFaceTB/SmolLM2-135M-Instruct"),
    ),
)  # fmt: skip

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# model_type -> (qkv bias, q/k norm) where the config does not say (attention_bias absent).
_FAMILY_FLAGS = {"qwen2": (True, False), "qwen3": (False, True)}


def load_model_spec(name_or_path: str | Path) -> ModelSpec:
    """A local config.json (or a folder holding one), else a catalogue name such as
    "Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct" or "default"."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _read_config(path)
    return find_model(str(name_or_path))


def find_model(name: str) -> ModelSpec:
    key = _normalize(DEFAULT_MODEL if name.lower() == "default" else name)
    for spec in CATALOGUE:
        if _normalize(spec.name) == key:
            return spec
    known = ", ".join(s.name for s in CATALOGUE)
    raise ModelSpecError(
        f"unknown model {name!r}: not a local config.json or folder, and not in the catalogue "
        f"({known})"
    )


def _normalize(name: str) -> str:
    # Hub ids, chat variants and quantized checkpoints name the same shapes:
    # "meta-llama/Meta-Llama-3.1-8B-Instruct", "Qwen2.5-7B-Instruct-AWQ", "Llama-2-7b-chat-hf",
    # "Mistral-7B-Instruct-v0.3", "Qwen3-14B-FP8".
    key = name.rsplit("/", 1)[-1].lower()
    key = re.sub(r"^meta-", "", key)
    key = re.sub(r"-(awq|gptq(-int[48])?|fp8(-dynamic)?|int[48]|w8a8|w4a16|hf)$", "", key)
    key = re.sub(r"-(instruct|chat)(?=$|-v)", "", key)
    return key


def _read_config(path: Path) -> ModelSpec:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise BadInputFile(path, "expected a JSON object (a Hugging Face config.json)")
    return parse_config(raw, name=path.parent.name, source=str(path))


def parse_config(raw: dict, name: str, source: str) -> ModelSpec:
    """The facts of a Hugging Face config.json (dict); multimodal configs nest them in
    text_config. Shape numbers must be positive integers below MAX_SHAPE."""
    text_config = raw.get("text_config")
    if text_config is not None and not isinstance(text_config, dict):
        raise ModelSpecError(f"{source}: text_config must be an object")
    raw = text_config or raw

    def need(key: str, default: int | None = None) -> int:
        value = raw.get(key) if raw.get(key) is not None else default
        if value is None:
            raise ModelSpecError(f"{source}: missing field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MAX_SHAPE:
            raise ModelSpecError(
                f"{source}: field {key!r} must be a positive integer below 2^31, not {value!r}"
            )
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    model_type = raw.get("model_type")
    family = model_type if isinstance(model_type, str) else ""
    bias_default, qk_norm = _FAMILY_FLAGS.get(family, (False, False))
    return ModelSpec(
        name=name,
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=need("num_key_value_heads", heads),
        head_dim=need("head_dim", hidden // heads),
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=need("max_position_embeddings", 2048),
        qkv_bias=bool(raw.get("attention_bias", bias_default)),
        qk_norm=qk_norm,
        source=source,
    )


# --- shapes under tensor parallelism -------------------------------------------------------------


def check_tp(spec: ModelSpec, tp: int) -> None:
    """The splits vLLM accepts: query heads and MLP columns divide evenly; KV heads either divide
    evenly or are replicated (tp a multiple of the KV head count)."""
    if tp < 1:
        raise ModelSpecError(f"tensor parallel size must be >= 1, got {tp}")
    problems = []
    if spec.num_heads % tp:
        problems.append(f"{spec.num_heads} attention heads")
    if spec.intermediate_size % tp:
        problems.append(f"intermediate size {spec.intermediate_size}")
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"{kv} KV heads (neither divides the other)")
    if problems:
        raise ModelSpecError(f"{spec.name}: tp={tp} does not split {', '.join(problems)}")


def kv_heads_per_gpu(spec: ModelSpec, tp: int = 1) -> int:
    # With tp > KV heads each GPU holds a replica of one KV head (vLLM replicates them).
    return max(1, spec.num_kv_heads // tp)


def linear_shapes(spec: ModelSpec, tp: int = 1) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's weight matrices on one of tp GPUs:
    q, k, v, o, gate, up, down (column-parallel q/k/v/gate/up, row-parallel o/down)."""
    check_tp(spec, tp)
    h, d = spec.hidden_size, spec.head_dim
    q = spec.num_heads // tp * d
    kv = kv_heads_per_gpu(spec, tp) * d
    inter = spec.intermediate_size // tp
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


@dataclass(slots=True, frozen=True)
class ParamCounts:
    """Parameters held by one of tp GPUs (all of them at tp=1), by the role they play."""

    embedding: int  # vocab x hidden, vocab-parallel
    lm_head: int  # vocab x hidden; 0 when tied to the embedding
    linear: int  # the seven weight matrices of every layer: what quantization shrinks
    layer_other: int  # per-layer RMSNorms, q/k norms and qkv biases
    final_norm: int

    @property
    def layers(self) -> int:
        return self.linear + self.layer_other

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.layers + self.final_norm


def param_counts(spec: ModelSpec, tp: int = 1) -> ParamCounts:
    shapes = linear_shapes(spec, tp)
    h, d = spec.hidden_size, spec.head_dim
    q_out, kv_out = shapes[0][1], shapes[1][1]
    per_layer_other = 2 * h  # input and post-attention RMSNorm (replicated)
    if spec.qkv_bias:
        per_layer_other += q_out + 2 * kv_out
    if spec.qk_norm:
        per_layer_other += 2 * d
    embedding = math.ceil(spec.vocab_size / tp) * h
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if spec.tie_word_embeddings else embedding,
        linear=spec.num_layers * sum(i * o for i, o in shapes),
        layer_other=spec.num_layers * per_layer_other,
        final_norm=h,
    )


def param_count(spec: ModelSpec) -> int:
    return param_counts(spec).total
