"""The planner against serving results nobody here measured: published benchmark figures
(`capacity/data/published.jsonl`, each with its source, engine version and full configuration)
simulated as they were run, and the efficiency table fitted on part of them.

Each case becomes a trace of its requests (fixed input and output lengths, prompts that share
nothing: benchmark prompts are random), an engine shape (the case's max_num_seqs and
max_num_batched_tokens, or vLLM's defaults for that version, GPU and entry point) and a KV pool
from the memory plan; the simulation runs the engine's scheduler on the performance model's
clock and yields the case's metric (output tokens/s, TPOT, ...), compared with the published one.

The fit: the schedule of a batch or closed-loop run does not depend on how long steps take (only
the order of steps and finishes matters), so each case is simulated once, its steps' features
kept, and the metric recomputed from them for any table in microseconds. A Nelder-Mead search over
the table's log-parameters minimises the absolute log error on the training cases (robust: one
odd case does not drag the rest), plus a weak pull towards the defaults for parameters the
training cases do not constrain; Poisson cases, whose schedule does depend on time, are
re-simulated between rounds."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from capacity.efficiency import (
    DEFAULTS,
    GENERATION,
    VLLM_V0,
    EfficiencyTable,
    bounds_of,
    engine_key,
    get,
    parameter_names,
    with_values,
)
from capacity.gpus import GpuSpec, find_gpu, load_gpus
from capacity.memory import activation_peak_bytes, overheads, plan_memory, weight_bytes
from capacity.model_specs import ModelSpec, load_model_spec, param_count
from capacity.perf import PerfModel, StepShape, model_costs, roofline
from capacity.simulate import EngineShape, Load, SimResult, simulate
from workload.input_file import BadInputFile, Fields, parse_json, text_lines
from workload.trace import TraceRecord

PUBLISHED_PATH = Path(__file__).parent / "data" / "published.jsonl"
METRICS = (
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_ttft_ms",
    "mean_itl_ms",
    "tokens_per_s_single",
    "mean_batch_latency_ms",
)
MODES = ("batch", "concurrency", "poisson", "single")
HELD_OUT_EVERY = 3  # one case in three (by a hash of its id) is held out of the fit
MAX_REQUESTS = 4000  # a larger published run is simulated with this many (steady state)
PRIOR_WEIGHT = 0.02
RESTARTS = 8  # pull of the defaults, in squared log units per parameter
TRTLLM_KV_FREE_FRACTION = 0.90
# Where the fit's search starts for terms the defaults leave out: the per-layer cost (s) and the
# soft roofline's exponent.
SEARCH_STARTS = {"t_layer": 5e-5, "roofline_p": 4.0}


@dataclass(frozen=True, slots=True)
class PublishedCase:
    id: str
    source: str
    url: str
    engine: str
    engine_version: str | None
    model: str
    gpu: str
    tp: int
    num_gpus: int
    dtype: str
    kv_cache_dtype: str | None
    input_len: int
    output_len: int
    num_requests: int | None
    mode: str
    concurrency: int | None
    rate: float | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    metric: str
    value: float
    per_gpu: bool = False
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    complete: bool = True  # every setting given by the source (else some are defaults)
    enforce_eager: bool = False  # vLLM run without CUDA graphs
    # Sent over HTTP to an OpenAI-compatible server by a benchmark client (vllm bench serve,
    # genai-perf); not: the engine's Python API (vLLM's LLM class, trtllm-bench).
    served: bool = False
    # Tokens the server's chat template wraps each prompt in (a client of the chat endpoint sends
    # messages): the engine prefills them, the source's token counts leave them out.
    chat_template_tokens: int = 0

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(self.id.encode()).digest()
        return digest[0] % HELD_OUT_EVERY == 0


@dataclass(frozen=True, slots=True)
class Skipped:
    id: str
    reason: str


def load_cases(path: Path = PUBLISHED_PATH) -> tuple[list[PublishedCase], list[Skipped]]:
    """The cases of a published.jsonl, each field checked (a bad line is a BadInputFile), and
    the records the planner cannot simulate, with why (no fixed lengths, a GPU or model the
    source does not pin down)."""
    cases, skipped = [], []
    for number, line in text_lines(path):
        if not line.strip():
            continue
        f = Fields.of(parse_json(line.rstrip("\r\n"), path, number), path, number)
        case_id = f.text("id") or ""
        if not case_id.strip():  # the held-out split and every message name the case by it
            raise f.error("id must be a non-empty string")
        mode = f.text("mode")
        if mode not in MODES:
            raise f.error(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        metric = f.text("metric")
        if metric not in METRICS:
            raise f.error(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")
        # The source's names, and the planner's catalogue names where they differ.
        model = f.text("planner_model", None) or f.text("model")
        gpu = f.text("planner_gpu", None) if "planner_gpu" in f.data else f.text("gpu", None)
        if gpu is None:
            named = f.text("gpu", None) or "no GPU named"
            skipped.append(Skipped(case_id, f"the source does not pin the GPU down ({named})"))
            continue
        if f.data.get("input_len") is None or f.data.get("output_len") is None:
            skipped.append(Skipped(case_id, "no fixed input/output lengths"))
            continue
        tp = f.integer("tp", 1, 1024, None) or f.integer("num_gpus", 1, 1024, None) or 1
        case = PublishedCase(
            id=case_id,
            source=f.text("source") or "",
            url=f.text("url") or "",
            engine=f.text("engine") or "",
            engine_version=f.text("engine_version", None),
            model=model or "",
            gpu=gpu,
            tp=tp,
            num_gpus=f.integer("num_gpus", 1, 1024, None) or tp,
            # Not stated: the engines' "auto", the checkpoint's own bf16.
            dtype=f.text("dtype", None) or "bf16",
            kv_cache_dtype=f.text("kv_cache_dtype", None),
            input_len=f.integer("input_len", 1, 10_000_000),
            output_len=f.integer("output_len", 1, 10_000_000),
            num_requests=f.integer("num_requests", 1, 10_000_000, None),
            mode=mode,
            concurrency=f.integer("concurrency", 1, 10_000_000, None),
            rate=f.number("rate", 0, 1e9, None),
            max_num_seqs=f.integer("max_num_seqs", 1, 10_000_000, None),
            max_num_batched_tokens=f.integer("max_num_batched_tokens", 1, 10_000_000, None),
            metric=metric,
            value=f.number("value", 0, 1e12),
            per_gpu=_flag(f, "per_gpu", False),
            gpu_memory_utilization=f.number("gpu_memory_utilization", 0, 1, None),
            max_model_len=f.integer("max_model_len", 1, 10_000_000, None),
            complete=_flag(f, "complete", True),
            enforce_eager=_flag(f, "enforce_eager", False),
            # Online modes are a client's; a batch of requests may be either.
            served=_flag(f, "served", mode in ("concurrency", "poisson")),
            chat_template_tokens=f.integer("chat_template_tokens", 0, 100_000, 0),
        )
        if case.value <= 0:
            raise f.error("value must be positive")
        _check_case(case, f)
        if mode == "concurrency" and not case.concurrency:
            raise f.error("mode concurrency needs concurrency")
        if mode == "poisson" and not case.rate:
            raise f.error("mode poisson needs rate")
        cases.append(case)
    ids = [c.id for c in cases] + [s.id for s in skipped]
    if dup := next((i for i in ids if ids.count(i) > 1), None):
        raise BadInputFile(path, f"case id {dup!r} appears twice")
    return cases, skipped


def _flag(f: Fields, key: str, default: bool) -> bool:
    """A true/false field: bool("no") would be True (a per-GPU figure divided by tp)."""
    value = f.data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise f.error(f"{key} must be true or false, not {json.dumps(value)[:40]}")
    return value


def _check_case(case: PublishedCase, f: Fields) -> None:
    """Settings that cannot describe a run (each would otherwise be simulated as something
    else, or end in a traceback)."""
    if case.gpu_memory_utilization == 0:  # `or 0.9` would plan it at the default
        raise f.error("gpu_memory_utilization must be in (0, 1], not 0")
    if case.num_gpus < case.tp:
        raise f.error(f"num_gpus {case.num_gpus} is fewer than tp {case.tp}")
    if case.metric in ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms") and case.output_len < 2:
        raise f.error(f"{case.metric} needs output_len >= 2 (a token after the first)")
    length = case.input_len + case.output_len
    if case.max_model_len is not None and case.max_model_len < length:
        raise f.error(
            f"max_model_len {case.max_model_len} is shorter than input_len + output_len {length}"
        )


# --- one case as it was run -------------------------------------------------------------------


def vllm_defaults(case: PublishedCase, gpu: GpuSpec) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) a vLLM of the case's version picks when not told:
    since v0.9 (EngineArgs.get_batch_defaults), GPUs of >= 70 GiB other than the A100 get
    1024 sequences and 16384 tokens offline (LLM class) / 8192 served, others 256 and 8192 /
    2048; V1 before it (0.8) 256 and 8192 / 2048; V0 256 sequences and no chunked prefill (the
    whole prompt in one step: max_model_len tokens)."""
    offline = not case.served
    version = _version(case.engine_version)
    if version >= (0, 9):
        if gpu.memory_bytes >= 70 * (1 << 30) and "a100" not in gpu.name.lower():
            return 1024, 16384 if offline else 8192
        return 256, 8192 if offline else 2048
    if version >= (0, 8):
        return 256, 8192 if offline else 2048
    return 256, max(case.input_len + case.output_len, 2048)


def trtllm_bench_settings(case: PublishedCase, spec: ModelSpec, gpu: GpuSpec) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) `trtllm-bench build --dataset` picks (its tuning
    heuristic, tensorrt_llm/bench/build/tuning.py: calc_engine_setting, finetune_setting): the
    requests of ISL + OSL tokens that 95% of the memory left beside the weights holds as KV
    (parameters in 1e9 x bytes, GPU memory in GiB, as it counts them), capped at 4096, rounded
    up; tokens = that batch x (1 + ISL / OSL), capped at 32768, at least 2048, rounded up."""
    fp8 = case.dtype == "fp8"
    kv_fp8 = (case.kv_cache_dtype or "").lower() == "fp8"
    gib_per_token = (
        2 * spec.num_layers * max(case.tp, spec.num_kv_heads) * spec.head_dim * (1 if kv_fp8 else 2)
    ) / (1 << 30)
    engine_gb = param_count(spec) / 1e9 * (1 if fp8 else 2)
    available = gpu.memory_bytes / (1 << 30) * case.tp - engine_gb
    requests = available * 0.95 / gib_per_token / (case.input_len + case.output_len)
    raw_bs = min(requests, 4096)
    raw_token = min(raw_bs * (1 + case.input_len / case.output_len), 32768)
    bs = max(64, _round_up(raw_bs, ((256, 32), (1024, 128), (math.inf, 256))))
    tokens = max(2048, _round_up(raw_token, ((4096, 256), (8192, 512), (math.inf, 1024))))
    return bs, tokens


def _round_up(value: float, tiers: tuple[tuple[float, int], ...]) -> int:
    """value rounded up to the step of the first tier whose bound it is below."""
    step = next(step for bound, step in tiers if value < bound)
    return step * math.ceil(value / step)


def timed_schedule(case: PublishedCase) -> bool:
    """Whether the case's schedule depends on the table, so that a new table needs a new
    simulation and not only a re-timing: arrivals in seconds (Poisson), and the HTTP front end's
    queue (which hands requests over at times, not at step ends)."""
    return case.mode == "poisson" or case.served


def engine_of(case: PublishedCase) -> str:
    """The case's engine as the efficiency table keys it: vLLM before 0.8 (V0) apart."""
    key = engine_key(case.engine)
    if key == "vllm" and _version(case.engine_version) < (0, 8):
        return VLLM_V0
    return key


def _version(text: str | None) -> tuple[int, ...]:
    parts = []
    for part in (text or "").lstrip("v").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or (999,)  # unknown: the newest defaults


@dataclass(slots=True)
class CaseRun:
    """A case simulated once: its steps' features and each request's step indices."""

    case: PublishedCase
    spec: ModelSpec
    gpu: GpuSpec
    shapes: list[StepShape]
    idle_s: np.ndarray  # per step, the idle time before it (Poisson gaps)
    first_step: np.ndarray  # per request, the step whose end gives its first token
    finish_step: np.ndarray
    arrival: np.ndarray  # per request: seconds (Poisson) or the step index it was sent after
    arrival_in_steps: bool
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    features: dict = field(default_factory=dict)


def build_run(case: PublishedCase, table: EfficiencyTable, gpus: dict | None = None) -> CaseRun:
    spec = load_model_spec(case.model)
    gpu = find_gpu(case.gpu, gpus or load_gpus())
    trtllm = engine_key(case.engine) == "tensorrt-llm"
    seqs, tokens = trtllm_bench_settings(case, spec, gpu) if trtllm else vllm_defaults(case, gpu)
    seqs, tokens = case.max_num_seqs or seqs, case.max_num_batched_tokens or tokens
    prompt = case.input_len + case.chat_template_tokens  # what the engine prefills
    length = prompt + case.output_len
    max_model_len = case.max_model_len or max(length, 2048)
    tokens = max(tokens, 1)
    nvlink = gpu.interconnect.lower().startswith("nvlink")
    kv_cache_memory = None
    if trtllm:
        # TensorRT-LLM sizes its KV pool as a share (trtllm-bench's kv_cache_free_gpu_mem_fraction,
        # 0.90) of the memory left free once the engine is loaded, not of the whole GPU as vLLM's
        # gpu_memory_utilization does: a 70B fp16 engine on two 80 GB GPUs keeps ~2.5x the KV.
        loaded = (
            weight_bytes(spec, case.dtype, case.tp)
            + activation_peak_bytes(spec, tokens, seqs, case.dtype, case.tp)
            + overheads(spec, case.tp, False, nvlink).total
        )
        kv_cache_memory = max(0, int(TRTLLM_KV_FREE_FRACTION * (gpu.memory_bytes - loaded)))
    memory = plan_memory(
        spec,
        gpu.memory_bytes,
        dtype=case.dtype,
        kv_dtype=_kv_dtype(case),
        tp=case.tp,
        utilization=case.gpu_memory_utilization or 0.9,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        max_model_len=max_model_len,
        # vLLM >= 0.21 takes its CUDA graphs out of the budget; earlier ones (and other engines)
        # allocated them beside it.
        cuda_graphs=engine_key(case.engine) == "vllm"
        and _version(case.engine_version) >= (0, 21)
        and not case.enforce_eager,
        nvlink=nvlink,
        kv_cache_memory=kv_cache_memory,
    )
    if trtllm:
        # TensorRT-LLM's default capacity scheduler (GUARANTEED_NO_EVICT) admits a request only
        # when the KV for its whole output is free: no preemption, at most pool / length
        # requests at once (vLLM admits on the prompt and preempts when decodes outgrow it).
        seqs = max(1, min(seqs, memory.num_tokens // length))
    engine = EngineShape(memory.num_blocks, 16, seqs, tokens, max_model_len)
    n = _num_requests(case, seqs)
    trace = [TraceRecord(0.0, prompt, case.output_len) for _ in range(n)]
    load = _load(case, n)
    model = _model(case, spec, gpu, table)
    shapes: list[StepShape] = []
    times: list[float] = []  # each step's time, as the simulation advanced the clock by it

    def step_time(shape: StepShape) -> float:
        shapes.append(shape)
        times.append(model.step_time(shape))
        return times[-1]

    sim = simulate(
        trace, step_time, engine, load=load, vocab=spec.vocab_size,
        request_cost_s=table.t_request_http if case.served else 0.0,
    )  # fmt: skip
    return _record(case, spec, gpu, sim, shapes, np.array(times), engine, model)


def _kv_dtype(case: PublishedCase) -> str | None:
    kv = (case.kv_cache_dtype or "auto").lower()
    return None if kv in ("auto", "none", "") else kv


def _num_requests(case: PublishedCase, max_num_seqs: int = 0) -> int:
    if case.mode == "single":
        return 1
    if case.metric == "mean_batch_latency_ms":  # one batch of `concurrency` requests
        return case.concurrency or case.num_requests or 1
    n = case.num_requests or (10 * case.concurrency if case.concurrency else 1000)
    # Steady state needs several waves of the engine's batch: a run of 30000 short requests on
    # an engine that holds 4096 at once is not one wave of 4000.
    return min(n, max(MAX_REQUESTS, 4 * max_num_seqs))


def _load(case: PublishedCase, n: int) -> Load:
    if case.mode == "concurrency" and case.metric != "mean_batch_latency_ms":
        return Load("concurrency", concurrency=case.concurrency)
    if case.mode == "poisson":
        return Load("poisson", rate=case.rate)
    return Load("batch")


def _model(case: PublishedCase, spec: ModelSpec, gpu: GpuSpec, table: EfficiencyTable):
    return PerfModel(
        model_costs(spec, case.dtype, _kv_dtype(case), case.tp),
        table.coefficients(gpu, case.dtype, case.tp, engine_of(case), case.enforce_eager),
    )


def _record(case, spec, gpu, sim: SimResult, shapes, times: np.ndarray, engine, model) -> CaseRun:
    ends = np.array([clock for clock, _ in sim.kv_usage])
    idle = np.diff(np.concatenate([[0.0], ends])) - times
    idle[idle < 1e-12] = 0.0

    def step_of(t: float) -> int:
        return int(np.searchsorted(ends, t - 1e-12 * max(1.0, t)))

    poisson = case.mode == "poisson"
    requests = sim.requests
    first = np.array([step_of(r.first_token_s) for r in requests])
    finish = np.array([step_of(r.finish_s) for r in requests])
    if poisson:
        arrival = np.array([r.arrival_s for r in requests])
    else:  # sent at 0 or when an earlier request finished (the end of some step): -1 = at 0
        arrival = np.array([step_of(r.arrival_s) if r.arrival_s > 0 else -1 for r in requests])
    run = CaseRun(
        case, spec, gpu, shapes, idle, first, finish, arrival, not poisson,
        engine.num_blocks, engine.max_num_seqs, engine.max_num_batched_tokens,
    )  # fmt: skip
    run.features = _features(shapes, model.costs)
    return run


def _features(shapes: list[StepShape], costs) -> dict:
    def column(f) -> np.ndarray:
        return np.array([f(s) for s in shapes], dtype=float)

    return {
        "gemm": column(lambda s: s.gemm_flops(costs)),
        "attention": column(lambda s: s.attention_flops(costs)),
        "kv": column(lambda s: s.kv_bytes(costs)),
        "rows": column(lambda s: s.sampled_rows),
        "tokens": column(lambda s: s.num_batched_tokens),
        "weights": float(costs.weight_bytes),
        "vocab": float(costs.vocab_size),
        "allreduces": float(costs.allreduces_per_step),
        "ar_bytes": float(costs.allreduce_bytes_per_token),
        "layers": float(costs.num_layers),
    }


def step_times(run: CaseRun, table: EfficiencyTable) -> np.ndarray:
    """The run's step times under another table: PerfModel.step_time, vectorised."""
    c = table.coefficients(
        run.gpu, run.case.dtype, run.case.tp, engine_of(run.case), run.case.enforce_eager
    )
    f = run.features
    gemm = roofline(f["gemm"] * c.k_compute, f["weights"] * c.k_memory, c.roofline_p)
    attention = roofline(f["attention"] * c.attention, f["kv"] * c.k_memory, c.roofline_p)
    layers = f.get("layers", float(run.spec.num_layers))
    overhead = c.t_step + c.t_layer * layers + f["rows"] * (c.t_row + c.t_logit * f["vocab"])
    allreduce = f["allreduces"] * c.t_allreduce + f["ar_bytes"] * f["tokens"] * c.k_link
    return gemm + attention + overhead + allreduce


def predict(run: CaseRun, table: EfficiencyTable) -> float:
    """The case's metric under the table, from the recorded schedule. A batch sent over HTTP:
    the engine waited only for the front end (its idle gaps came from t_request_http), so the
    gaps are left out and the run takes at least the front end's time for every request (a
    two-stage pipeline; the simulation itself queues them, see build_run)."""
    case = run.case
    frontend = case.served and case.mode == "batch"
    ends = np.cumsum(step_times(run, table) + (0.0 if frontend else run.idle_s))
    if run.arrival_in_steps:
        arrival = np.where(run.arrival < 0, 0.0, ends[np.maximum(run.arrival, 0)])
    else:
        arrival = run.arrival
    first, finish = ends[run.first_step], ends[run.finish_step]
    n = len(first)
    makespan = finish.max() - arrival.min()
    if frontend:
        makespan = max(makespan, n * table.t_request_http)
    out = case.output_len
    tpot = (finish - first) / max(out - 1, 1)
    if case.metric == "output_tokens_per_s":
        value = n * out / makespan
    elif case.metric == "total_tokens_per_s":
        value = n * (case.input_len + out) / makespan
    elif case.metric == "requests_per_s":
        value = n / makespan
    elif case.metric == "mean_tpot_ms":
        value = float(tpot.mean()) * 1000
    elif case.metric == "median_tpot_ms":
        value = float(np.median(tpot)) * 1000
    elif case.metric == "mean_itl_ms":
        value = float((finish - first).sum() / max(n * (out - 1), 1)) * 1000
    elif case.metric == "mean_ttft_ms":
        value = float((first - arrival).mean()) * 1000
    elif case.metric == "mean_batch_latency_ms":
        value = makespan * 1000
    else:  # tokens_per_s_single: one request's output over its whole latency
        value = out / float((finish - arrival).mean())
    if case.per_gpu and case.metric.endswith("_per_s"):
        value /= case.tp  # a throughput per GPU of a TP group
    return value


def error_pct(run: CaseRun, table: EfficiencyTable) -> float:
    return (predict(run, table) - run.case.value) / run.case.value * 100


# --- the fit ---------------------------------------------------------------------------------


@dataclass(slots=True)
class FitResult:
    table: EfficiencyTable
    train: list[str]
    test: list[str]
    rounds: int


def fit_table(
    runs: list[CaseRun],
    start: EfficiencyTable = DEFAULTS,
    *,
    rounds: int = 2,
    only: tuple[str, ...] = (),
) -> FitResult:
    """Fit the table on the runs not held out (see module docstring). only: fit these of the
    free parameters, the others kept at `start`'s values (a change of the model that touches a
    few terms, refitted in minutes rather than the full search's hour; the engines' plain
    factors and the HTTP front end's cost are not refitted either)."""
    train = [r for r in runs if not r.case.held_out]
    if not train:
        raise ValueError("no training cases")
    generations = tuple(sorted({_generation(r.gpu) for r in train} - {""}))
    names = free_parameters(train)
    if only:
        if unknown := [n for n in only if n not in names]:
            raise ValueError(
                f"not a free parameter of these cases: {', '.join(unknown)} "
                f"(free: {', '.join(names)})"
            )
        names = [n for n in names if n in only]
    table = start
    # Parameters whose default is "no such term" (0) start inside the range the data spans, not
    # at zero, whose logarithm the search cannot leave in a few steps; no pull towards the start.
    table = with_values(
        table, {n: v for n, v in SEARCH_STARTS.items() if n in names and get(table, n) == 0}
    )
    for gen in generations:  # every generation starts from the defaults' fractions
        if gen not in table.generations:
            table = with_values(table, {f"{gen}.{k}": get(table, f"{gen}.{k}") for k in
                                        ("gemm", "memory", "t_step")})  # fmt: skip
    for round_ in range(rounds):
        if round_:
            train = [build_run(r.case, table) if timed_schedule(r.case) else r for r in train]
        # Nelder-Mead stalls in many dimensions: restart from its own result until it stops
        # improving.
        best = _objective(train, table, names, start)
        for _ in range(RESTARTS):
            table = _nelder_mead(train, table, names, start)
            value = _objective(train, table, names, start)
            if value > best - 1e-6:
                break
            best = value
    if not only:  # a partial fit leaves the engines' plain factors and the front end as they are
        table = _engine_means(table, names)
        table = fit_request_cost(train, table)
    ids = [r.case.id for r in train]
    basis = f"fitted on {len(ids)} published cases"
    if only:
        basis += f", {len(names)} of its terms refitted from the start table ({', '.join(names)})"
    table = replace(table, basis=basis, fitted_on=ids)
    test = [r.case.id for r in runs if r.case.held_out]
    return FitResult(table, ids, test, rounds)


def free_parameters(train: list[CaseRun]) -> list[str]:
    """The parameters the training cases constrain. Another engine's factors are per generation
    where vLLM ran too (elsewhere the factor and the generation's own fractions are one
    product: its plain factor); the NVLink share is per generation that ran TP over NVLink (the
    shared one is what other GPUs get)."""
    generations = tuple(sorted({_generation(r.gpu) for r in train} - {""}))
    with_vllm = {_generation(r.gpu) for r in train if engine_of(r.case) == "vllm"}
    engines = {
        f"{engine_of(r.case)}/{gen}"
        if (gen := _generation(r.gpu)) in with_vllm
        else engine_of(r.case)
        for r in train
    }
    links = tuple(sorted({_generation(r.gpu) for r in train if _nvlink_tp(r)} - {""}))
    return [
        n
        for n in parameter_names(generations, tuple(sorted(engines)), links)
        if _constrained(n, train) and not (n == "link" and links)
    ]


def fit_request_cost(runs: list[CaseRun], table: EfficiencyTable) -> EfficiencyTable:
    """t_request_http, by itself: the served batches' figures only depend on it where the front
    end is the bottleneck (short requests at a high rate), elsewhere not at all, so a local
    search started where it does not bind never moves it. A grid over 10 us .. 0.3 s (log
    spaced) against the served training cases, the other terms fixed; without served cases the
    table's value stays."""
    served = [r for r in runs if r.case.served and not r.case.held_out]
    if not served:
        return table

    def error(value: float) -> float:
        t = with_values(table, {"t_request_http": value})
        return sum(abs(math.log(predict(r, t) / r.case.value)) for r in served)

    grid = [1e-5 * 10 ** (i / 40) for i in range(int(40 * math.log10(3e4)) + 1)]
    return with_values(table, {"t_request_http": min(grid, key=error)})


def _engine_means(table: EfficiencyTable, names: list[str]) -> EfficiencyTable:
    """An engine fitted per generation only: its plain factor (what a generation it did not run
    on gets) is the geometric mean of its per-generation ones. A plain factor the fit set
    itself (the engine on generations without vLLM) stays."""
    values = {}
    for prefix, factors in (
        ("engine:", table.engines),
        ("engine_overhead:", table.engine_overheads),
    ):
        per_engine: dict[str, list[float]] = {}
        for key, value in factors.items():
            engine, _, generation = key.partition("/")
            if generation and f"{prefix}{key}" in names:
                per_engine.setdefault(engine, []).append(value)
        for engine, found in per_engine.items():
            if prefix + engine not in names:
                values[prefix + engine] = math.exp(sum(map(math.log, found)) / len(found))
    return with_values(table, values)


def _nvlink_tp(run: CaseRun) -> bool:
    return run.case.tp > 1 and run.gpu.interconnect.lower().startswith("nvlink")


def _constrained(name: str, runs: list[CaseRun]) -> bool:
    """Whether any training case depends on the parameter: the all-reduce terms need a TP case
    over that link; the rest every case has."""
    tp = [r for r in runs if r.case.tp > 1]
    nvlink = [r for r in tp if _nvlink_tp(r)]
    if name == "allreduce_nvlink_s":
        return bool(nvlink)
    if name == "allreduce_pcie_s":
        return len(nvlink) < len(tp)
    if name == "link":
        return bool(nvlink)
    if name == "link_pcie":
        return len(nvlink) < len(tp)
    if name == "t_layer_eager":
        return any(r.case.enforce_eager for r in runs)
    if name == "t_request_http":
        return False  # fit_request_cost's, after the search
    return True


def _generation(gpu: GpuSpec) -> str:
    return GENERATION.get(gpu.name, "")


def _objective(runs, table, names, start) -> float:
    total = 0.0
    for run in runs:
        value = predict(run, table)
        total += abs(math.log(value / run.case.value))
    for name in names:
        a, b = get(table, name), get(start, name)
        if a > 0 and b > 0:
            total += PRIOR_WEIGHT * abs(math.log(a / b))
    return total


def _nelder_mead(runs, table, names, start, iterations: int = 1500) -> EfficiencyTable:
    """Minimise the objective over the parameters, each searched in log space (zero-valued
    ones from a small floor) within its bounds."""
    floors = {"t_step": 1e-4, "t_row": 1e-6, "t_logit": 1e-12, "allreduce_nvlink_s": 1e-6,
              "allreduce_pcie_s": 1e-6, "t_layer": 1e-6}  # fmt: skip

    def x_of(t: EfficiencyTable) -> np.ndarray:
        return np.array(
            [math.log(max(get(t, n), floors.get(n.split(".")[-1], 1e-6))) for n in names]
        )

    def table_of(x: np.ndarray) -> EfficiencyTable:
        values = {}
        for name, v in zip(names, x):
            low, high = bounds_of(name)
            values[name] = min(max(math.exp(min(v, 50.0)), low), high)
        return with_values(table, values)

    def f(x: np.ndarray) -> float:
        return _objective(runs, table_of(x), names, start)

    x0 = x_of(table)
    simplex = [x0] + [x0 + np.eye(len(x0))[i] * 0.5 for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-10:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        reflected = centroid + (centroid - worst)
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - worst)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (worst - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return table_of(simplex[int(np.argmin(values))])
