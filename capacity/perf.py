"""Step time as a function of the batch: a roofline times efficiency factors, plus overheads.

For one engine step with T batched tokens, S sampled rows and A attention query-key pairs:

    FLOPs = 2 * P_layers * T  +  2 * hidden * vocab * S  +  4 * layers * heads * head_dim * A
    bytes = weight bytes  +  KV bytes per token * context tokens read
    time  = max(FLOPs * k_compute, bytes * k_memory) + t_step + t_row * S

k_compute = 1 / (efficiency_compute * peak FLOP/s), k_memory = 1 / (efficiency_memory * peak
bandwidth): the roofline's two ceilings, each reached only in part. t_step is the per-step cost
outside the kernels (scheduling, launches, the serving loop); t_row the per-sampled-row cost
(sampling, detokenization, streaming). `calibrate.py` fits k_compute, k_memory, t_step and t_row
on a step profile of the machine; uncalibrated hardware uses its datasheet with the default
efficiencies below, and is reported as an estimate."""

from __future__ import annotations

from dataclasses import dataclass

from capacity.memory import (
    WEIGHT_FORMATS,
    compute_dtype,
    kv_bytes_per_token,
    normalize_dtype,
    weight_bytes,
)
from capacity.model_specs import ModelSpec, param_counts

# Defaults for hardware nobody has measured: fractions of datasheet peaks that well-tuned serving
# engines report for large batches (vLLM / SGLang on A100/H100: dense GEMMs at 60-70% of bf16
# peak, decode at 70-80% of HBM bandwidth), and a few ms of per-step host overhead.
DEFAULT_COMPUTE_EFFICIENCY = 0.6
DEFAULT_MEMORY_EFFICIENCY = 0.75
DEFAULT_STEP_OVERHEAD_S = 0.004
DEFAULT_ROW_OVERHEAD_S = 0.0


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What a step costs per unit of work, for one model at one dtype (per GPU under TP)."""

    layer_params: int  # parameters of the transformer layers (not embeddings, not LM head)
    lm_head_params: int  # hidden * vocab
    weight_bytes: int  # all weights read each step
    attention_flops_per_pair: int  # 4 * layers * heads * head_dim
    kv_bytes_per_token: int


@dataclass(frozen=True, slots=True)
class StepShape:
    num_batched_tokens: int
    sampled_rows: int
    attention_pairs: int
    context_tokens: int  # KV tokens read (sum of the scheduled requests' context lengths)

    def flops(self, costs: ModelCosts) -> float:
        return (
            2.0 * costs.layer_params * self.num_batched_tokens
            + 2.0 * costs.lm_head_params * self.sampled_rows
            + costs.attention_flops_per_pair * self.attention_pairs
        )

    def bytes(self, costs: ModelCosts) -> float:
        return costs.weight_bytes + costs.kv_bytes_per_token * self.context_tokens


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    flops_per_s: float  # peak (datasheet) or measured matmul rate
    bytes_per_s: float  # peak (datasheet) or measured copy bandwidth
    basis: str  # "measured" (with how) or "datasheet"


@dataclass(frozen=True, slots=True)
class PerfCoefficients:
    k_compute: float  # s per FLOP
    k_memory: float  # s per byte
    t_step: float  # s per step
    t_row: float  # s per sampled row
    basis: str  # "calibrated on ..." or "datasheet estimate"

    @staticmethod
    def from_datasheet(hw: Hardware) -> PerfCoefficients:
        return PerfCoefficients(
            k_compute=1.0 / (DEFAULT_COMPUTE_EFFICIENCY * hw.flops_per_s),
            k_memory=1.0 / (DEFAULT_MEMORY_EFFICIENCY * hw.bytes_per_s),
            t_step=DEFAULT_STEP_OVERHEAD_S,
            t_row=DEFAULT_ROW_OVERHEAD_S,
            basis=f"datasheet estimate ({hw.name}, default efficiencies)",
        )

    def efficiencies(self, hw: Hardware) -> tuple[float, float]:
        """(compute, memory) efficiency against the hardware's peaks."""
        return 1.0 / (self.k_compute * hw.flops_per_s), 1.0 / (self.k_memory * hw.bytes_per_s)


@dataclass(frozen=True, slots=True)
class PerfModel:
    costs: ModelCosts
    coefficients: PerfCoefficients

    def step_time(self, shape: StepShape) -> float:
        c = self.coefficients
        compute = shape.flops(self.costs) * c.k_compute
        memory = shape.bytes(self.costs) * c.k_memory
        return max(compute, memory) + c.t_step + c.t_row * shape.sampled_rows


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
    return ModelCosts(
        layer_params=counts.layers,
        lm_head_params=lm_head,
        weight_bytes=weight_bytes(spec, dtype, tp) - unread,
        attention_flops_per_pair=4 * spec.num_layers * (spec.num_heads // tp) * spec.head_dim,
        kv_bytes_per_token=kv,
    )
