"""GPU memory budget, the vLLM way: how many KV-cache blocks fit beside the weights.

    KV blocks = floor((utilization x GPU memory - weights - activation peak - overhead)
                      / bytes per block)
    bytes per block = block_size x KV bytes per token

all per GPU: tensor parallelism splits the weights, the KV heads (replicated once tp exceeds
them) and the activations, so every GPU holds the same number of blocks, each for a slice of the
heads. vLLM measures the activation peak and the non-torch memory by profiling a forward pass;
here both are estimated from the model's shapes and the constants below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity.model_specs import ModelSpec, kv_heads_per_gpu, linear_shapes, param_counts

MIB = 1 << 20
GIB = 1 << 30

# --- overheads, per GPU -----------------------------------------------------------------------
# The CUDA context (driver state and lazily loaded kernel images): typically 0.3-0.6 GiB on
# Ampere/Hopper with CUDA 12's lazy module loading (our estimate; not measured here). vLLM takes
# its first memory snapshot after the context exists and requires free memory >= utilization x
# total, so the context must fit in the (1 - utilization) headroom rather than in the budget;
# plan_memory checks that.
CUDA_CONTEXT_BYTES = 512 * MIB
# Memory allocated outside torch during the forward pass (cuBLAS/cuBLASLt workspaces, attention
# kernels' scratch). vLLM logs it as "non_torch_memory": 0.16 GiB for Llama-3.2-11B on an H100
# (vLLM PR #12126, Jan 2025), 0.20 GiB on 24 GB cards (PR #14447), 0.33 GiB on an RTX 5090
# (issue #14452); we take the upper end, rounded.
NON_TORCH_BYTES = 512 * MIB
# NCCL communicator buffers (NCCL_BUFFSIZE = 4 MiB per channel, protocol and peer) and vLLM's
# custom all-reduce buffers, only when tp > 1. vLLM PR #10511 (Dec 2024) logged non-torch memory
# of 1.79 GiB at TP=1 and 3.58 GiB at TP=2 for Llama-3-8B on H100; later versions count less of
# it. 1 GiB is our middle estimate.
NCCL_BYTES = 1 * GIB
# CUDA-graph pools for decode/mixed batches at vLLM's default capture sizes. vLLM >= 0.21 profiles
# and subtracts them; its logs show 0.11-0.73 GiB per GPU for dense models (0.11 GiB in
# aivrar/vllm-windows-build#4, "Estimated CUDA graph memory: 0.36 GiB" per TP worker in
# gpustack/runner PR #251, 0.73 GiB in vLLM PR #39559). 0 with enforce_eager.
CUDA_GRAPH_BYTES = 512 * MIB

# --- bytes per element ----------------------------------------------------------------------
# Quantized formats shrink only the seven linear weight matrices of each layer; embeddings,
# lm_head, norms and biases stay in bf16 (vLLM's fp8/int8/AWQ/GPTQ paths leave them unquantized).
UNQUANTIZED_BYTES = 2
# fp8 / int8 (W8A8) scales: one float32 per output channel of each matrix (some checkpoints store
# bf16 scales; the difference is under 0.01% of the weights).
CHANNEL_SCALE_BITS = 32
# int4 (AWQ / GPTQ layout): per group of 128 input elements and output channel, one 16-bit scale
# and one 4-bit zero point packed eight to an int32 (their "scales" and "qzeros" tensors).
INT4_GROUP_SIZE = 128
INT4_GROUP_BITS = 16 + 4
# The sampler works on float32 logits.
LOGIT_BYTES = 4


class MemoryPlanError(ValueError):
    """The model does not fit as asked: weights, headroom, KV pool or max_model_len."""


@dataclass(slots=True, frozen=True)
class WeightFormat:
    bits: int  # per element of a linear weight matrix
    other_bytes: int  # per element of everything else (embeddings, lm_head, norms, biases)
    channel_scale_bits: int = 0  # per output channel of each matrix
    group_size: int = 0  # input elements per quantization group (0: no groups)
    group_bits: int = 0  # per group and output channel


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat(32, 4),
    "bf16": WeightFormat(16, 2),
    "fp16": WeightFormat(16, 2),
    "fp8": WeightFormat(8, UNQUANTIZED_BYTES, channel_scale_bits=CHANNEL_SCALE_BITS),
    "int8": WeightFormat(8, UNQUANTIZED_BYTES, channel_scale_bits=CHANNEL_SCALE_BITS),
    "int4": WeightFormat(
        4, UNQUANTIZED_BYTES, group_size=INT4_GROUP_SIZE, group_bits=INT4_GROUP_BITS
    ),
}
# KV cache element sizes (vLLM's --kv-cache-dtype; its fp8 variants e4m3 / e5m2 are one byte with
# one float scale per layer, which is no memory to speak of). int8 is the 8-bit KV cache of
# TensorRT-LLM and LMDeploy: one byte an element, its scales as negligible.
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "awq": "int4",
    "gptq": "int4",
}


def normalize_dtype(dtype: str, table: dict) -> str:
    name = _ALIASES.get(dtype.lower(), dtype.lower())
    if name not in table:
        raise MemoryPlanError(f"unknown dtype {dtype!r}; choose one of {', '.join(table)}")
    return name


def compute_dtype(dtype: str) -> str:
    """The dtype activations (and, by default, the KV cache) use: quantized weights compute in
    bf16."""
    name = normalize_dtype(dtype, WEIGHT_FORMATS)
    return name if name in ("fp32", "fp16") else "bf16"


# --- the three costs --------------------------------------------------------------------------


def weight_bytes(spec: ModelSpec, dtype: str = "bf16", tp: int = 1) -> int:
    """Bytes of weights on one of tp GPUs."""
    fmt = WEIGHT_FORMATS[normalize_dtype(dtype, WEIGHT_FORMATS)]
    layer_bits = sum(_matrix_bits(fan_in, out, fmt) for fan_in, out in linear_shapes(spec, tp))
    counts = param_counts(spec, tp)
    other = counts.embedding + counts.lm_head + counts.layer_other + counts.final_norm
    return math.ceil(spec.num_layers * layer_bits / 8) + other * fmt.other_bytes


def _matrix_bits(fan_in: int, out: int, fmt: WeightFormat) -> int:
    bits = fan_in * out * fmt.bits + out * fmt.channel_scale_bits
    if fmt.group_size:
        bits += math.ceil(fan_in / fmt.group_size) * out * fmt.group_bits
    return bits


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """K and V of one token over all layers, on one of tp GPUs."""
    nbytes = KV_DTYPE_BYTES[normalize_dtype(kv_dtype, KV_DTYPE_BYTES)]
    return 2 * spec.num_layers * kv_heads_per_gpu(spec, tp) * spec.head_dim * nbytes


def activation_peak_bytes(
    spec: ModelSpec,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: str = "bf16",
    tp: int = 1,
) -> int:
    """The largest set of intermediates alive at once in one layer's forward over a full token
    budget T, on one of tp GPUs (layers run one after another, so one layer's peak is the model's):

        residual stream + normed input     2 x T x hidden
        + max(attention: q,k,v + attention output   T x (2 q_heads + 2 kv_heads) x head_dim,
              MLP: gate|up + SiLU(gate) x up          3 x T x intermediate)
    in the compute dtype, plus the float32 logits of the sampled rows, min(max_num_seqs, T) x vocab
    (the full vocabulary: vLLM gathers the vocab-parallel logits before sampling)."""
    tokens = max_num_batched_tokens
    elem = WEIGHT_FORMATS[compute_dtype(dtype)].other_bytes
    (_, q_out), (_, kv_out) = linear_shapes(spec, tp)[:2]
    inter = spec.intermediate_size // tp
    residual = 2 * tokens * spec.hidden_size
    attention = tokens * (2 * q_out + 2 * kv_out)
    mlp = 3 * tokens * inter
    logits = min(max_num_seqs, tokens) * spec.vocab_size * LOGIT_BYTES
    return (residual + max(attention, mlp)) * elem + logits


def overhead_bytes(tp: int = 1, cuda_graphs: bool = True) -> int:
    """Memory in the budget that is neither weights, activations nor KV, per GPU."""
    return (
        NON_TORCH_BYTES + (NCCL_BYTES if tp > 1 else 0) + (CUDA_GRAPH_BYTES if cuda_graphs else 0)
    )


# --- the plan ---------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    """Where one GPU's memory goes (every GPU of a tp group holds the same amounts)."""

    model: str
    tp: int
    dtype: str
    kv_dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    gpu_memory_bytes: int
    budget_bytes: int  # utilization x GPU memory
    weight_bytes: int
    activation_bytes: int
    overhead_bytes: int  # non-torch + NCCL + CUDA graphs
    kv_bytes: int  # the KV pool, whole blocks only
    kv_bytes_per_token: int
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_per_request(self, request_tokens: int) -> int:
        """Blocks one request of request_tokens (input + output) tokens holds at its end."""
        return math.ceil(request_tokens / self.block_size)

    def max_concurrent(self, request_tokens: int) -> int:
        """How many requests of request_tokens (input + output) the KV pool holds at once; the
        scheduler further caps the running requests at max_num_seqs."""
        return self.num_blocks // self.blocks_per_request(request_tokens)


def plan_memory(
    spec: ModelSpec,
    gpu_memory_bytes: int,
    *,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    tp: int = 1,
    utilization: float = 0.9,
    block_size: int = 16,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None = None,
    cuda_graphs: bool = True,
    kv_cache_memory: int | None = None,
) -> MemoryPlan:
    """The KV pool left on each GPU. kv_dtype defaults to the compute dtype; max_model_len to the
    model's max_position_embeddings. kv_cache_memory fixes the pool's bytes instead of deriving
    them from utilization (vLLM's kv_cache_memory_bytes, our EngineConfig.kv_cache_memory)."""
    kv_dtype = normalize_dtype(kv_dtype or compute_dtype(dtype), KV_DTYPE_BYTES)
    max_model_len = max_model_len or spec.max_position_embeddings
    _check_args(spec, utilization, block_size, max_model_len, max_num_batched_tokens, max_num_seqs)
    weights = weight_bytes(spec, dtype, tp)
    activation = activation_peak_bytes(spec, max_num_batched_tokens, max_num_seqs, dtype, tp)
    overhead = overhead_bytes(tp, cuda_graphs)
    per_token = kv_bytes_per_token(spec, kv_dtype, tp)
    budget = math.floor(utilization * gpu_memory_bytes)
    where = f"{spec.name} ({dtype}, tp={tp}) on {_gib(gpu_memory_bytes)} GiB"
    if kv_cache_memory is None:
        _check_weights(where, weights, budget, f"{utilization:g} x {_gib(gpu_memory_bytes)} = ")
        _check_headroom(where, gpu_memory_bytes, budget)
        pool = budget - weights - activation - overhead
    else:  # a fixed pool: only the whole must fit the GPU
        _check_weights(where, weights + activation + overhead + kv_cache_memory, gpu_memory_bytes)
        pool = kv_cache_memory
    blocks = max(0, pool) // (block_size * per_token)
    _check_pool(where, blocks, block_size, max_model_len, pool)
    return MemoryPlan(
        model=spec.name,
        tp=tp,
        dtype=normalize_dtype(dtype, WEIGHT_FORMATS),
        kv_dtype=kv_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        gpu_memory_bytes=gpu_memory_bytes,
        budget_bytes=budget,
        weight_bytes=weights,
        activation_bytes=activation,
        overhead_bytes=overhead,
        kv_bytes=blocks * block_size * per_token,
        kv_bytes_per_token=per_token,
        num_blocks=blocks,
    )


def _check_args(
    spec: ModelSpec, utilization: float, block_size: int, max_model_len: int, *counts: int
) -> None:
    if not 0 < utilization <= 1:
        raise MemoryPlanError(f"utilization must be in (0, 1], got {utilization}")
    if min(block_size, *counts) < 1:
        raise MemoryPlanError(
            "block_size, max_num_batched_tokens and max_num_seqs must be >= 1, got "
            f"{block_size}, {counts[0]}, {counts[1]}"
        )
    if max_model_len > spec.max_position_embeddings:
        raise MemoryPlanError(
            f"max_model_len {max_model_len} exceeds {spec.name}'s max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )


def _check_weights(where: str, need: int, limit: int, how: str = "") -> None:
    if need > limit:
        what = "the weights take" if how else "weights, activations, overhead and KV pool take"
        raise MemoryPlanError(
            f"{where}: {what} {_gib(need)} GiB per GPU but the budget is {how}{_gib(limit)} GiB; "
            f"use a larger tp, a smaller dtype (fp8, int4) or a larger GPU"
        )


def _check_headroom(where: str, gpu_memory_bytes: int, budget: int) -> None:
    headroom = gpu_memory_bytes - budget
    if headroom < CUDA_CONTEXT_BYTES:
        raise MemoryPlanError(
            f"{where}: utilization leaves {_gib(headroom)} GiB outside the budget, less than the "
            f"{_gib(CUDA_CONTEXT_BYTES)} GiB CUDA context; lower the utilization"
        )


def _check_pool(where: str, blocks: int, block_size: int, max_model_len: int, pool: int) -> None:
    if blocks < 1:
        raise MemoryPlanError(
            f"{where}: no memory left for the KV cache ({_gib(pool)} GiB after weights, "
            f"activations and overhead); raise the utilization, lower max_num_batched_tokens, "
            f"use a larger tp or a smaller dtype"
        )
    if math.ceil(max_model_len / block_size) > blocks:
        raise MemoryPlanError(
            f"{where}: max_model_len {max_model_len} needs {math.ceil(max_model_len / block_size)} "
            f"KV blocks but the pool holds {blocks} ({blocks * block_size} tokens); lower "
            f"--max-model-len to at most {blocks * block_size} (if the workload's requests fit "
            f"in that), or free memory for the KV cache (--utilization, a larger --tp, a smaller "
            f"--dtype)"
        )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"
