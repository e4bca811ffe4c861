"""GPU memory budget, the vLLM way: how many KV-cache blocks fit beside the weights.

    KV blocks = floor((utilization x GPU memory - weights - activation peak - overhead)
                      / bytes per block)
    bytes per block = block_size x KV bytes per token
    overhead = non-torch memory (+ NCCL buffers with tp > 1) (+ CUDA graphs, vLLM >= 0.21)

all per GPU: tensor parallelism splits the weights, the KV heads (replicated once tp exceeds
them) and the activations, so every GPU holds the same number of blocks, each for a slice of the
heads. GPU memory is the total CUDA reports (capacity/gpus.py), which vLLM multiplies by
gpu_memory_utilization. This is vLLM v1's budget (vllm/v1/worker/gpu_worker.py,
determine_available_memory: requested = utilization x total; KV = requested - (weights + torch
peak increase + non-torch increase of a profiling forward pass at max_num_batched_tokens), since
v0.21 minus the CUDA graph estimate too). vLLM measures the activation peak and the non-torch
memory by that forward pass; here both are estimated, from the model's shapes and the constants
below, and checked against the block counts vLLM printed (tests/capacity/test_published_kv.py).
The CUDA context is outside the budget: vLLM only requires the free memory at startup to hold
the request, so a utilization that leaves less than a context beside it may not start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capacity.model_specs import ModelSpec, kv_heads_per_gpu, linear_shapes, param_counts

MIB = 1 << 20
GIB = 1 << 30

# --- overheads, per GPU -----------------------------------------------------------------------
# Figures vLLM printed (capacity/data/published_kv.jsonl quotes the lines). "llm-d" is the
# llm-d-planner accuracy sweep: vLLM 0.19.0 on H100 80GB HBM3 at utilization 0.95, 20 logs
# (github.com/llm-d-incubation/llm-d-planner, commit d3121e0, accuracy/results/v0.19.0/logs).
#
# The CUDA context (driver state, kernel images) and whatever else holds memory when vLLM takes
# its startup snapshot: 0.51 GiB on the H100 at TP 1 (llm-d: "free_memory=78.68GiB,
# total_memory=79.19GiB, cuda_memory=0.51GiB"). It is not in the budget: vLLM >= 0.9.1 refuses to
# start when the free memory at startup is less than utilization x total, so it must fit beside
# the budget. Contexts differ by GPU and driver and nothing here measures them, so plan_memory
# warns when the headroom is smaller than this one, and refuses only a headroom of nothing
# (utilization 1), which no context fits. vLLM 0.7 had no such check and ran 2x RTX 4090 at
# 0.98 (vllm issue #13061), a headroom of 0.47 GiB.
CUDA_CONTEXT_BYTES = round(0.51 * GIB)
# Memory allocated outside torch during the profiling forward pass (cuBLAS/cuBLASLt workspaces,
# attention kernels' scratch), vLLM's "non-torch memory": 0.24-0.27 GiB in the 12 llm-d logs at
# TP 1 (0.25 in most), 0.25 GiB on 2x RTX 4090 (vllm issue #13061), 0.35 GiB on an RTX 3090
# (vllm issue #10517), 0.16 GiB on an H100 (vllm PR #12126), 0.05 GiB on an A10 (Oracle AQUA
# troubleshooting doc). The llm-d figure, the one of the newest vLLM.
NON_TORCH_BYTES = round(0.25 * GIB)
# With tp > 1 over NVLink, NCCL's and the all-reduce's buffers add to the non-torch memory: 2.06
# to 2.21 GiB at TP 2 and 4 in the 8 llm-d logs (median 2.10) against 0.25 at TP 1, so 1.85 GiB
# more. Over PCIe (no NVLink buffers, no custom all-reduce without P2P) 2x RTX 4090 logged 0.25
# GiB in all (vllm issue #13061, vLLM 0.7): nothing more. A100's NVLink 3 has no log here; it
# gets the NVLink figure, which errs on the side of fewer blocks.
NCCL_NVLINK_BYTES = round(1.85 * GIB)
NCCL_PCIE_BYTES = 0
# CUDA graph pools at vLLM's default capture sizes (up to 512 sequences), per layer of the
# model: llm-d logged "CUDA graph pool memory (actual)" of 0.87-1.07 GiB at TP 1 for models of
# 28-40 layers (27.1-31.8 MiB a layer: Llama-3.1-8B 0.91 GiB / 32, Qwen2.5-7B 0.87 / 28, Qwen3-8B
# 0.96 / 36, phi-4 1.07 / 40) and 20.6-24.3 MiB a layer at TP 2 and 4. vLLM >= 0.21 estimates and
# subtracts them from the KV pool ("CUDA graph memory profiling is enabled (default since
# v0.21.0)"); vLLM 0.19 allocated them outside the budget. 0 with enforce_eager.
CUDA_GRAPH_BYTES_PER_LAYER = 28 * MIB

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
# The profiling run's sampler (vLLM v1 _dummy_sampler_run over min(max_num_seqs, tokens) rows of
# the full vocabulary): the logits in the compute dtype, then three float32 arrays of that shape
# alive at once (the float32 logits, the softmax probabilities, and the exponential noise the
# random sampler divides them by). With the layer peak below this matches the activation peaks
# llm-d logged to -5..-10% (Llama-3.1-8B 1.78 GiB for 1.89, Qwen2.5-7B 2.09 for 2.21).
SAMPLER_FLOAT32_COPIES = 3
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
# Nightshift's own fp8 / int8 KV cache (engine/attention/kv_quant.py) keeps a float32 scale per
# token and KV head beside the codes, for K and for V: 4 bytes more per head row, 6% of an fp8 row
# at head_dim 64 (3% at 128). plan_memory(..., kv_token_scales=True) counts them, and then
# computes the engine's block count exactly (tests/engine/test_kv_cache_dtype.py builds it).
KV_TOKEN_SCALE_BYTES = 4
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


def kv_bytes_per_token(
    spec: ModelSpec, kv_dtype: str = "bf16", tp: int = 1, *, token_scales: bool = False
) -> int:
    """K and V of one token over all layers, on one of tp GPUs. token_scales: a 1-byte KV dtype
    also keeps a scale per token and KV head (KV_TOKEN_SCALE_BYTES), as this engine's does;
    vLLM's fp8 cache has one per layer, counted as nothing."""
    name = normalize_dtype(kv_dtype, KV_DTYPE_BYTES)
    per_head = spec.head_dim * KV_DTYPE_BYTES[name]
    if token_scales and name in ("fp8", "int8"):
        per_head += KV_TOKEN_SCALE_BYTES
    return 2 * spec.num_layers * kv_heads_per_gpu(spec, tp) * per_head


def activation_peak_bytes(
    spec: ModelSpec,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: str = "bf16",
    tp: int = 1,
) -> int:
    """vLLM's profiling run, on one of tp GPUs: a forward pass over a full token budget T, then the
    sampler over R = min(max_num_seqs, T) rows. Its peak is the larger of

      the layer's: residual stream, normed input, projection output    3 x T x hidden
                   + max(attention: q,k,v + attention output     T x (2 q_heads + 2 kv_heads)
                         MLP: gate|up + SiLU(gate) x up           3 x T x intermediate)
                   in the compute dtype (layers run one after another: one layer's peak is
                   the model's);
      the sampler's: the hidden states T x hidden (compute dtype) and R x vocab logits in the
                   compute dtype plus three float32 copies (SAMPLER_FLOAT32_COPIES; the full
                   vocabulary: vLLM gathers the vocab-parallel logits onto every rank).

    Checked against vLLM's logged peaks: 2.06 GiB for 2.07 at T = 20,000 (Llama-3.1-8B, RTX 3090,
    vllm issue #10517) and 2.99 for 2.99 at T = 29,000, where the layer term is the peak; see
    SAMPLER_FLOAT32_COPIES where the sampler's is."""
    tokens = max_num_batched_tokens
    elem = WEIGHT_FORMATS[compute_dtype(dtype)].other_bytes
    (_, q_out), (_, kv_out) = linear_shapes(spec, tp)[:2]
    inter = spec.intermediate_size // tp
    stream = 3 * tokens * spec.hidden_size
    attention = tokens * (2 * q_out + 2 * kv_out)
    mlp = 3 * tokens * inter
    layer = (stream + max(attention, mlp)) * elem
    rows = min(max_num_seqs, tokens)
    sampler = tokens * spec.hidden_size * elem + rows * spec.vocab_size * (
        elem + SAMPLER_FLOAT32_COPIES * LOGIT_BYTES
    )
    return max(layer, sampler)


@dataclass(slots=True, frozen=True)
class Overheads:
    """Memory in the budget that is neither weights, activations nor KV, per GPU."""

    non_torch_bytes: int  # cuBLAS workspaces, kernels' scratch
    nccl_bytes: int  # communicator and all-reduce buffers (tp > 1)
    cuda_graph_bytes: int  # graph pools (vLLM >= 0.21 subtracts them)

    @property
    def total(self) -> int:
        return self.non_torch_bytes + self.nccl_bytes + self.cuda_graph_bytes


def overheads(
    spec: ModelSpec, tp: int = 1, cuda_graphs: bool = True, nvlink: bool = True
) -> Overheads:
    """The overheads of one GPU of a tp group; nvlink: whether the group talks over NVLink (its
    NCCL buffers are larger), else PCIe."""
    nccl = 0 if tp == 1 else NCCL_NVLINK_BYTES if nvlink else NCCL_PCIE_BYTES
    graphs = spec.num_layers * CUDA_GRAPH_BYTES_PER_LAYER if cuda_graphs else 0
    return Overheads(NON_TORCH_BYTES, nccl, graphs)


def overhead_bytes(
    spec: ModelSpec, tp: int = 1, cuda_graphs: bool = True, nvlink: bool = True
) -> int:
    return overheads(spec, tp, cuda_graphs, nvlink).total


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
    overheads: Overheads | None = None  # overhead_bytes, item by item
    # Outside the budget: what the CUDA context is assumed to take (CUDA_CONTEXT_BYTES), and
    # what the headroom beside the budget leaves for it.
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    warnings: tuple[str, ...] = ()  # what may stop vLLM from starting as planned

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
    nvlink: bool = True,
    kv_token_scales: bool = False,
) -> MemoryPlan:
    """The KV pool left on each GPU of gpu_memory_bytes (the total CUDA reports). kv_dtype
    defaults to the compute dtype; max_model_len to the model's max_position_embeddings.
    kv_cache_memory fixes the pool's bytes instead of deriving them from utilization (vLLM's
    kv_cache_memory_bytes, our EngineConfig.kv_cache_memory). cuda_graphs: the graphs' memory is
    in the budget (vLLM >= 0.21; False for enforce_eager or vLLM <= 0.20, which allocated them
    beside it); nvlink: the tp group talks over NVLink (False: PCIe); kv_token_scales: an fp8 /
    int8 KV cache with a scale per token and KV head, Nightshift's layout (False: vLLM's, one
    per layer)."""
    kv_dtype = normalize_dtype(kv_dtype or compute_dtype(dtype), KV_DTYPE_BYTES)
    max_model_len = max_model_len or spec.max_position_embeddings
    _check_args(spec, utilization, block_size, max_model_len, max_num_batched_tokens, max_num_seqs)
    weights = weight_bytes(spec, dtype, tp)
    activation = activation_peak_bytes(spec, max_num_batched_tokens, max_num_seqs, dtype, tp)
    items = overheads(spec, tp, cuda_graphs, nvlink)
    overhead = items.total
    per_token = kv_bytes_per_token(spec, kv_dtype, tp, token_scales=kv_token_scales)
    budget = math.floor(utilization * gpu_memory_bytes)
    where = f"{spec.name} ({dtype}, tp={tp}) on {_gib(gpu_memory_bytes)} GiB"
    warnings: tuple[str, ...] = ()
    if kv_cache_memory is None:
        _check_weights(where, weights, budget, f"{utilization:g} x {_gib(gpu_memory_bytes)} = ")
        warnings = _check_headroom(where, gpu_memory_bytes, budget, utilization)
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
        overheads=items,
        warnings=warnings,
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


def _check_headroom(
    where: str, gpu_memory_bytes: int, budget: int, utilization: float
) -> tuple[str, ...]:
    """vLLM starts only if the free memory at startup (total less the CUDA context) holds the
    budget: nothing beside it never does; less than an H100's context may not."""
    headroom = gpu_memory_bytes - budget
    if headroom <= 0:
        raise MemoryPlanError(
            f"{where}: utilization {utilization:g} leaves nothing beside the budget for the CUDA "
            f"context, and vLLM refuses to start when the free memory at startup is less than "
            f"the budget; lower the utilization"
        )
    if headroom < CUDA_CONTEXT_BYTES:
        return (
            f"utilization {utilization:g} leaves {_gib(headroom)} GiB beside the budget, less "
            f"than the {_gib(CUDA_CONTEXT_BYTES)} GiB CUDA context an H100 showed at vLLM's "
            f'startup: vLLM >= 0.9.1 refuses to start if the free memory then (its log: "Free '
            f'memory on device") is below the budget. Check it on the GPU, or lower the '
            f"utilization",
        )
    return ()


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
