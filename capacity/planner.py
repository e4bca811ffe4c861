"""The planner's answers for one workload: per GPU and tensor-parallel size, where memory goes,
how long tonight's batch takes (the engine's scheduler on a virtual clock, timed by the
performance model), how many GPUs meet the deadline, and what that costs - next to the same
tokens at a cloud API's prices."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from capacity.calibrate import Calibration
from capacity.efficiency import EfficiencyTable, load_table
from capacity.gpus import GpuSpec
from capacity.memory import (
    WEIGHT_FORMATS,
    MemoryPlan,
    MemoryPlanError,
    normalize_dtype,
    plan_memory,
)
from capacity.model_specs import ModelSpec, ModelSpecError, check_tp
from capacity.perf import Hardware, PerfCoefficients, PerfModel, StepShape, model_costs
from capacity.simulate import EngineShape, Load, SimResult, Speculation, simulate
from workload.trace import TraceRecord

MAX_REPLICAS = 256
DAYS_PER_MONTH = 30
# Tensor-parallel sizes tried when the asked one does not fit: the sizes one node offers.
LARGER_TPS = (2, 4, 8)

StepTime = Callable[[StepShape], float]


@dataclass(frozen=True, slots=True)
class PlanSettings:
    dtype: str = "bf16"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    utilization: float = 0.9
    deadline_s: float | None = None
    api_price_in: float | None = None  # USD per million input tokens
    api_price_out: float | None = None
    # The engine's max_model_len; None: the longest request rounded up to 1024 (at most the
    # model's context). Smaller than the longest request is refused.
    max_model_len: int | None = None
    # How requests arrive (the replay's modes); the nightly job sends everything at once.
    load: Load = field(default_factory=Load)
    # The KV cache's dtype (fp8, int8: 1 byte; bf16, fp16: 2; fp32: 4); None: the compute dtype
    # (vLLM's --kv-cache-dtype auto).
    kv_cache_dtype: str | None = None
    # Speculative decoding as the server runs it (the digest's local server: n-gram), or None.
    speculation: Speculation | None = None
    # vLLM's --enforce-eager: no CUDA graphs (no graph memory, each layer's kernels launched
    # from the host every step).
    enforce_eager: bool = False


@dataclass(slots=True)
class GpuPlan:
    gpu: GpuSpec
    tp: int
    memory: MemoryPlan | None = None
    error: str | None = None  # why this GPU / tp cannot run the model
    basis: str = ""  # how the times were obtained
    coefficients: PerfCoefficients | None = None  # the step-time model's, as assumed
    hardware: Hardware | None = None  # the peaks the efficiencies are fractions of
    fits_at_tp: int | None = None  # when this tp does not fit: the smallest of LARGER_TPS that does
    # s per request on the HTTP path before the scheduler (the table's t_request_http; 0 when
    # calibrated: a step profile does not measure it)
    request_cost_s: float = 0.0
    sim: SimResult | None = None
    replicas: int = 1  # tp groups needed to meet the deadline (1 without a deadline)
    replica_makespan_s: float = 0.0  # one replica's share of the batch
    latency: dict = field(default_factory=dict)  # name -> {p50, p90, p99} seconds

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.replica_makespan_s / 3600

    @property
    def cost_per_night(self) -> float:
        return self.gpu_hours * self.gpu.price_per_hour


def datasheet_hardware(gpu: GpuSpec, dtype: str) -> Hardware:
    """The GPU's datasheet peaks for weights of `dtype` (fp8 and int8 GEMMs on fp8 tensor cores
    where it has them, as efficiency.py's coefficients assume)."""
    low_precision = dtype in ("fp8", "int8") and gpu.fp8_tflops
    tflops = gpu.fp8_tflops if low_precision else gpu.bf16_tflops
    return Hardware(gpu.name, tflops * 1e12, gpu.bandwidth_gbps * 1e9, "datasheet")


def request_lengths(trace: list[TraceRecord]) -> dict[str, int]:
    """p50 / p90 / p99 of input + output tokens per request."""
    totals = np.array([r.input_length + r.output_length for r in trace])
    return {f"p{q}": int(np.percentile(totals, q)) for q in (50, 90, 99)}


def api_cost(trace: list[TraceRecord], settings: PlanSettings) -> float | None:
    if settings.api_price_in is None or settings.api_price_out is None:
        return None
    tokens_in = sum(r.input_length for r in trace)
    tokens_out = sum(r.output_length for r in trace)
    return (tokens_in * settings.api_price_in + tokens_out * settings.api_price_out) / 1e6


def coefficients_for(
    gpu: GpuSpec,
    dtype: str,
    calibration: Calibration | None,
    tp: int = 1,
    table: EfficiencyTable | None = None,
    eager: bool = False,
) -> PerfCoefficients:
    """The calibration when it was made on this GPU, else the datasheet with the efficiency
    table (fitted on published results)."""
    if _calibrated(gpu, calibration):
        return calibration.coefficients
    return (table or load_table()).coefficients(gpu, dtype, tp, eager=eager)


def _calibrated(gpu: GpuSpec, calibration: Calibration | None) -> bool:
    return calibration is not None and _same_gpu(calibration.machine, gpu)


def _same_gpu(machine: str, gpu: GpuSpec) -> bool:
    names = {gpu.name.lower(), *(a.lower() for a in gpu.aliases)}
    return machine.lower() in names


def plan_gpu(
    spec: ModelSpec,
    trace: list[TraceRecord],
    gpu: GpuSpec,
    tp: int,
    settings: PlanSettings,
    calibration: Calibration | None = None,
) -> GpuPlan:
    result = GpuPlan(gpu, tp)
    longest = max(r.input_length + r.output_length for r in trace)
    max_model_len = settings.max_model_len or min(
        spec.max_position_embeddings, math.ceil(longest / 1024) * 1024
    )
    if max_model_len < longest:
        result.error = (
            f"--max-model-len {max_model_len} is shorter than the workload's longest request "
            f"({longest} tokens, prompt and output)"
        )
        return result
    try:
        check_tp(spec, tp)
        result.memory = _memory(spec, gpu, tp, settings, max_model_len)
    except (MemoryPlanError, ModelSpecError) as exc:
        result.error = str(exc)
        result.fits_at_tp = smallest_fitting_tp(spec, gpu, tp, settings, max_model_len)
        return result
    table = None if _calibrated(gpu, calibration) else load_table()
    coefficients = coefficients_for(
        gpu, settings.dtype, calibration, tp, table, eager=settings.enforce_eager
    )
    result.basis = coefficients.basis
    result.coefficients = coefficients
    if table is not None:
        result.request_cost_s = table.t_request_http
    result.hardware = datasheet_hardware(gpu, normalize_dtype(settings.dtype, WEIGHT_FORMATS))
    step_time = _step_time(spec, tp, settings.dtype, settings.kv_cache_dtype, coefficients)
    # A pool larger than the whole workload's tokens behaves like one that holds exactly them;
    # capping it keeps a huge GPU from allocating millions of simulated blocks.
    needed = sum(math.ceil((r.input_length + max(1, r.output_length)) / settings.block_size)
                 for r in trace)  # fmt: skip
    engine = EngineShape(
        num_blocks=min(result.memory.num_blocks, needed + 1),
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    result.sim = simulate(
        trace, step_time, engine, load=settings.load, speculation=settings.speculation,
        request_cost_s=result.request_cost_s,
    )  # fmt: skip
    if engine.num_blocks < result.memory.num_blocks:  # usage of the real pool, not the cap
        scale = engine.num_blocks / result.memory.num_blocks
        result.sim.kv_usage = [(t, used * scale) for t, used in result.sim.kv_usage]
    result.replicas, shard = _replicas(
        trace, step_time, engine, result.sim, settings, result.request_cost_s
    )
    result.replica_makespan_s = shard.makespan_s
    result.latency = _latency(result.sim)
    return result


def _memory(
    spec: ModelSpec, gpu: GpuSpec, tp: int, settings: PlanSettings, max_model_len: int
) -> MemoryPlan:
    return plan_memory(
        spec,
        gpu.memory_bytes,
        dtype=settings.dtype,
        kv_dtype=settings.kv_cache_dtype,
        tp=tp,
        utilization=settings.utilization,
        block_size=settings.block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=max_model_len,
        cuda_graphs=not settings.enforce_eager,
        nvlink=gpu.interconnect.lower().startswith("nvlink"),
    )


def smallest_fitting_tp(
    spec: ModelSpec, gpu: GpuSpec, tp: int, settings: PlanSettings, max_model_len: int
) -> int | None:
    """The smallest tensor-parallel size of LARGER_TPS above tp that the model's heads divide
    and whose memory plan fits, or None."""
    for larger in (t for t in LARGER_TPS if t > tp):
        try:
            check_tp(spec, larger)
            _memory(spec, gpu, larger, settings, max_model_len)
        except (MemoryPlanError, ModelSpecError):
            continue
        return larger
    return None


def _step_time(
    spec: ModelSpec, tp: int, dtype: str, kv_dtype: str | None, coefficients: PerfCoefficients
) -> StepTime:
    return PerfModel(model_costs(spec, dtype, kv_dtype, tp), coefficients).step_time


def _replicas(
    trace: list[TraceRecord],
    step_time: StepTime,
    engine: EngineShape,
    whole: SimResult,
    settings: PlanSettings,
    request_cost_s: float = 0.0,
) -> tuple[int, SimResult]:
    """The fewest replicas whose share of the batch (every n-th request, and its share of the
    load's rate or concurrency) ends by the deadline."""
    deadline_s = settings.deadline_s
    if deadline_s is None or whole.makespan_s <= deadline_s:
        return 1, whole
    # Past MAX_REPLICAS the answer is "more than we plan": report MAX_REPLICAS, which then shows
    # as missing the deadline.
    replicas = min(MAX_REPLICAS, max(2, math.ceil(whole.makespan_s / deadline_s)))
    shard = whole
    while replicas <= MAX_REPLICAS:
        shard = simulate(
            trace[::replicas],
            step_time,
            engine,
            load=settings.load.split(replicas),
            speculation=settings.speculation,
            request_cost_s=request_cost_s,
        )
        if shard.makespan_s <= deadline_s:
            return replicas, shard
        replicas += 1
    return MAX_REPLICAS, shard


def _latency(sim: SimResult) -> dict:
    def pct(values: list[float]) -> dict:
        if not values:
            return {}
        return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}

    tpots = [t for r in sim.requests if (t := r.tpot_s) is not None]
    return {
        "ttft": pct([r.ttft_s for r in sim.requests]),
        "tpot": pct(tpots),
        "e2e": pct([r.e2e_s for r in sim.requests]),
    }
