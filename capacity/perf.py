"""Step time as a function of the batch: two rooflines times efficiency factors, plus overheads.

For one engine step with T batched tokens, S sampled rows, A attention query-key pairs and C
context tokens read, on one GPU of a tensor-parallel group:

    GEMMs      max(2 P_layers T + 2 hidden vocab S  FLOPs x k_compute,  weight bytes x k_memory)
  + attention  max(4 layers heads head_dim A  FLOPs x k_attention,  KV bytes/token C x k_memory)
  + t_step  +  t_layer layers  +  t_row S  +  t_logit S vocab
  + with tp > 1: 2 layers all-reduces x t_allreduce  +  all-reduce bytes x T x k_link

The GEMMs and the attention are separate kernels, each bound by its own ceiling: a large decode
batch is compute-bound in its GEMMs while its attention still streams the KV cache. Near the
ridge a kernel reaches neither ceiling (loads and math overlap imperfectly): with roofline_p > 0
the two times combine as (a^p + b^p)^(1/p) instead of max(a, b), which p -> infinity recovers.
k = 1 / (efficiency x peak). t_step is the per-step cost outside the kernels (scheduling,
launches, the serving loop; CUDA graphs make it smaller), t_layer the fixed cost of one layer's
kernels whatever their size (a kernel takes microseconds even when its work takes less: what makes
a small model's single request slower than its weights' read), t_row the host's cost per sampled
row (detokenization, streaming), t_logit the sampler's per row and vocabulary entry (softmax,
top-k/p over float32 logits), t_allreduce the latency of one all-reduce of the hidden states (two
per layer with tp > 1) and k_link the seconds per byte a ring all-reduce moves over the GPU link.

`calibrate.py` fits k_compute, k_memory, k_attention, t_step and t_row on a step profile of a
machine; `efficiency.py` gives GPUs nobody here measured their coefficients from the datasheet and
an efficiency table fitted on published results (`published.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capacity.memory import (
    WEIGHT_FORMATS,
    compute_dtype,
    kv_bytes_per_token,
    normalize_dtype,
    weight_bytes,
)
from capacity.model_specs import ModelSpec, param_counts

ACTIVATION_BYTES = 2  # bf16 hidden states, what the all-reduce moves


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What a step costs per unit of work, for one model at one dtype (per GPU under TP)."""

    layer_params: int  # parameters of the transformer layers (not embeddings, not LM head)
    lm_head_params: int  # hidden * vocab / tp
    weight_bytes: int  # all weights read each step
    attention_flops_per_pair: int  # 4 * layers * heads * head_dim
    kv_bytes_per_token: int
    vocab_size: int = 0  # logits per sampled row (the sampler sees the whole vocabulary)
    allreduces_per_step: int = 0  # 2 per layer with tp > 1
    allreduce_bytes_per_token: float = 0.0  # a ring's traffic per GPU and batched token
    num_layers: int = 0


@dataclass(frozen=True, slots=True)
class StepShape:
    num_batched_tokens: int
    sampled_rows: int
    attention_pairs: int
    context_tokens: int  # KV tokens read (sum of the scheduled requests' context lengths)

    def gemm_flops(self, costs: ModelCosts) -> float:
        return (
            2.0 * costs.layer_params * self.num_batched_tokens
            + 2.0 * costs.lm_head_params * self.sampled_rows
        )

    def attention_flops(self, costs: ModelCosts) -> float:
        return float(costs.attention_flops_per_pair * self.attention_pairs)

    def kv_bytes(self, costs: ModelCosts) -> float:
        return float(costs.kv_bytes_per_token * self.context_tokens)

    def flops(self, costs: ModelCosts) -> float:
        return self.gemm_flops(costs) + self.attention_flops(costs)

    def bytes(self, costs: ModelCosts) -> float:
        return costs.weight_bytes + self.kv_bytes(costs)


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    flops_per_s: float  # peak (datasheet) or measured matmul rate
    bytes_per_s: float  # peak (datasheet) or measured copy bandwidth
    basis: str  # "measured" (with how) or "datasheet"


@dataclass(frozen=True, slots=True)
class PerfCoefficients:
    k_compute: float  # s per GEMM FLOP
    k_memory: float  # s per byte read from GPU memory
    t_step: float  # s per step
    t_row: float  # s per sampled row
    basis: str  # "calibrated on ..." or "datasheet estimate ..."
    k_attention: float | None = None  # s per attention FLOP; None: k_compute
    t_logit: float = 0.0  # s per sampled row and vocabulary entry
    t_allreduce: float = 0.0  # s per all-reduce (latency)
    k_link: float = 0.0  # s per byte over the GPU-to-GPU link
    t_layer: float = 0.0  # s per layer and step (the kernels' fixed cost)
    roofline_p: float = 0.0  # 0: max(compute, memory); p > 0: their p-norm (a soft ridge)

    @property
    def attention(self) -> float:
        return self.k_compute if self.k_attention is None else self.k_attention

    def efficiencies(self, hw: Hardware) -> tuple[float, float]:
        """(compute, memory) efficiency against the hardware's peaks."""
        return 1.0 / (self.k_compute * hw.flops_per_s), 1.0 / (self.k_memory * hw.bytes_per_s)


@dataclass(frozen=True, slots=True)
class StepTerms:
    """A step's time by part, in seconds: what the report and the fit look at."""

    gemm: float
    attention: float
    overhead: float  # t_step + t_layer layers + t_row S + t_logit S vocab
    allreduce: float

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.overhead + self.allreduce


@dataclass(frozen=True, slots=True)
class PerfModel:
    costs: ModelCosts
    coefficients: PerfCoefficients

    def terms(self, shape: StepShape) -> StepTerms:
        c, costs = self.coefficients, self.costs
        rows = shape.sampled_rows
        return StepTerms(
            gemm=roofline(
                shape.gemm_flops(costs) * c.k_compute, costs.weight_bytes * c.k_memory, c.roofline_p
            ),
            attention=roofline(
                shape.attention_flops(costs) * c.attention,
                shape.kv_bytes(costs) * c.k_memory,
                c.roofline_p,
            ),
            overhead=c.t_step
            + c.t_layer * costs.num_layers
            + c.t_row * rows
            + c.t_logit * rows * costs.vocab_size,
            allreduce=costs.allreduces_per_step * c.t_allreduce
            + costs.allreduce_bytes_per_token * shape.num_batched_tokens * c.k_link,
        )

    def step_time(self, shape: StepShape) -> float:
        return self.terms(shape).total


def roofline(compute_s, memory_s, p: float = 0.0):
    """A kernel's time from its compute-bound and memory-bound times (floats or numpy arrays):
    the larger (p = 0), or their p-norm."""
    if p <= 0:
        return np.maximum(compute_s, memory_s)
    return (compute_s**p + memory_s**p) ** (1.0 / p)


def model_costs(
    spec: ModelSpec, dtype: str = "bf16", kv_dtype: str | None = None, tp: int = 1
) -> ModelCosts:
    """ModelCosts of one GPU of a tp group. The embedding table is not read as a whole each step
    (only the rows of the step's tokens), unless it doubles as the LM head."""
    counts = param_counts(spec, tp)
    fmt = WEIGHT_FORMATS[normalize_dtype(dtype, WEIGHT_FORMATS)]
    unread = 0 if spec.tie_word_embeddings else counts.embedding * fmt.other_bytes
    lm_head = counts.embedding  # vocab/tp x hidden, tied or not
    kv = kv_bytes_per_token(spec, kv_dtype or compute_dtype(dtype), tp)
    # Megatron-style TP: one all-reduce after attention and one after the MLP, per layer. A ring
    # sends and receives 2 (tp - 1) / tp of the hidden states per GPU.
    ring = 2 * (tp - 1) / tp * spec.hidden_size * ACTIVATION_BYTES
    return ModelCosts(
        layer_params=counts.layers,
        lm_head_params=lm_head,
        weight_bytes=weight_bytes(spec, dtype, tp) - unread,
        attention_flops_per_pair=4 * spec.num_layers * (spec.num_heads // tp) * spec.head_dim,
        kv_bytes_per_token=kv,
        vocab_size=spec.vocab_size,
        allreduces_per_step=2 * spec.num_layers if tp > 1 else 0,
        allreduce_bytes_per_token=2 * spec.num_layers * ring if tp > 1 else 0.0,
        num_layers=spec.num_layers,
    )
