"""From a model folder to a ready LlamaModel on a device, in the requested dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import SINGLE, TensorParallel
from engine.errors import ModelLoadError
from engine.kernels.cpu_decode import DecodeStep
from engine.models.llama import LlamaModel
from engine.models.model_config import ModelConfig, load_model_config
from engine.models.ops import make_ops
from engine.models.sharding import ShardPlan
from engine.models.weights import load_weights
from engine.quant.checkpoint import load_quantized, quantization_config
from engine.quant.gguf_blocks import INT4_TYPES, gguf_types, load_gguf_weights
from engine.quant.quantize import quantize_model

INT4_NAMES = frozenset(t.name for t in INT4_TYPES)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}") from e


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    # fp32 on CPU: this class of CPU has no native bf16 and runs it several times slower.
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_kernels(kind: str, device: torch.device) -> str:
    """ "auto": Triton kernels on CUDA, torch on the CPU (where Triton runs only interpreted).
    "cpu" (torch with the fused C kernels) is opt-in for now: faster at batch 1, but a served
    run at concurrency 8 measured several times slower, not yet explained (docs/PERFORMANCE.md)."""
    if kind == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return kind


def attention_backend(kind: str) -> AttentionBackend:
    if kind == "triton":
        # Imported only when chosen: Triton is not needed (or installed) for the CPU path.
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if kind == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    return TorchAttentionBackend()


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    kernels: str = "torch",
    tp: TensorParallel = SINGLE,
    *,
    quantization: str | None = None,
    group_size: int = 32,
) -> LlamaModel:
    """The model, or with tensor parallelism this rank's shard of it (tp.rank of tp.size);
    with `quantization` (int8, int4, fp8) its projections quantized (each rank its shard)."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model path {model_dir} is not a directory")
    config = load_model_config(model_dir)
    plan = ShardPlan(config, tp.rank, tp.size)
    qconfig = quantization_config(model_dir)
    source = _gguf_blocks_source(model_dir, quantization, group_size)
    if qconfig is not None:
        if quantization not in (None, qconfig["format"]):
            raise ModelLoadError(
                f"{model_dir} holds {qconfig['format']} weights; --quantization "
                f"{quantization} needs the float checkpoint it came from"
            )
        weights, shapes = load_quantized(model_dir, qconfig, dtype, plan)
        quantization = None  # as stored
    elif source is not None:  # the GGUF's own 4-bit blocks: the bytes llama.cpp reads
        weights, shapes = load_gguf_weights(source, dtype, plan)
    else:
        weights, shapes = load_weights(model_dir, dtype, plan)
    _check_shapes(config, shapes)
    weights = {name: t.to(device) for name, t in weights.items()}
    model = LlamaModel(
        config, weights, max_positions, attention_backend(kernels), ops=kernels, tp=tp, plan=plan
    )
    del weights  # the float projections go once quantized
    if quantization is not None:
        quantize_model(model, quantization, group_size)
    model.decode_step = DecodeStep.of(model)
    if model.decode_step is not None:
        # A decode token then goes through the same kernels whichever path runs it (a step of
        # decodes only, or one with prompt chunks in it), so a request's tokens do not depend
        # on what else is in the batch.
        model.ops = make_ops("cpu")
        model.backend = CpuAttentionBackend()
    return model


def _gguf_blocks_source(model_dir: Path, quantization: str | None, group_size: int) -> Path | None:
    """The GGUF a folder was converted from, when int4 in groups of 32 is asked and the file's
    projections are 4-bit blocks already: loading those is exact, quantizing their float32
    dequantization again would not be."""
    if quantization != "int4" or group_size != 32:
        return None
    from engine.model_fetch import gguf_source

    source = gguf_source(model_dir)
    if source is None:
        return None
    types = gguf_types(source)
    projections = [t for name, t in types.items() if name.endswith("_proj.weight")]
    return source if projections and all(t in INT4_NAMES for t in projections) else None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, with the shape config.json implies."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config.qkv_bias:
        per_layer.update(
            {f"self_attn.{n}_proj.bias": (size,) for n, size in zip("qkv", (q, kv, kv))}
        )
    if config.qk_norm:
        per_layer.update({f"self_attn.{n}_norm.weight": (config.head_dim,) for n in "qk"})
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(config.num_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _check_shapes(config: ModelConfig, weights: dict[str, tuple[int, ...]]) -> None:
    expected = expected_shapes(config)
    if "lm_head.weight" in weights and not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for name, shape in expected.items():
        if name not in weights:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        if tuple(weights[name]) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(weights[name])}, config implies {shape}"
            )
