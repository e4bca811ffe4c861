"""Coefficients for GPUs nobody here measured: the datasheet's peaks times efficiencies.

A datasheet peak is never reached: dense GEMMs run at some fraction of the tensor-core rate (less
in fp8 than in bf16 on Hopper, more on a large-L2 Ampere part), attention kernels at a lower one,
decode reads at a fraction of the HBM/GDDR bandwidth, and every step pays host and launch
overheads that CUDA graphs shrink but do not remove. The fractions differ by GPU generation, so
they are a table per chip family (data-centre Ada, GeForce Ada, Ampere GDDR, Ampere, Hopper),
with the share of the NVLink bandwidth an all-reduce reaches where a family has its own, plus
terms the families share: the per-row host cost, the sampler's cost per logit, all-reduce latency
per link type and the PCIe share. Another engine than vLLM (whose design ours follows) is a
factor on the GEMM efficiency and one on the fixed costs, per family where vLLM's own results
exist beside it.

The table the planner uses (`capacity/data/efficiency.json`) is fitted on published results
(`published.py`, `nightshift capacity validate --published --fit`), on a training part of the
cases only; the error on the rest is reported apart. Without the file the defaults below apply,
and the report says so."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from capacity.gpus import GpuSpec
from capacity.perf import PerfCoefficients
from workload.input_file import Fields, read_json

TABLE_PATH = Path(__file__).parent / "data" / "efficiency.json"

# Which chip family each catalogue GPU belongs to (a GPU of a user file: "other", the defaults):
# the families differ in tensor-core generation and in memory (HBM or GDDR), which is what the
# efficiencies depend on. The A10G (GA102, GDDR6) is Ampere like the A100 (GA100, HBM2e) but
# not its memory system. The GeForce RTX 4090 (AD102 like the L40S) is apart from the data-centre
# Ada parts: it runs 16-bit GEMMs with fp32 accumulate at half the tensor rate (its catalogue peak
# is that half) with 450 W for fewer SMs, where a 350 W L40S cannot hold its full-rate peak's
# clocks, so the two reach different fractions of their datasheet peaks.
GENERATION = {
    "RTX 4090": "ada-geforce",
    "L4": "ada",
    "L40S": "ada",
    "A10G": "ampere-gddr",
    "A100-40GB": "ampere",
    "A100-80GB": "ampere",
    "H100-SXM": "hopper",
    "H200": "hopper",
}
GENERATIONS = ("ada", "ada-geforce", "ampere-gddr", "ampere", "hopper")
NVLINK_PREFIX = "nvlink"


@dataclass(frozen=True, slots=True)
class Efficiency:
    """One generation's fractions of its datasheet peaks, and its per-step overhead."""

    gemm: float  # dense GEMMs, of the 16-bit tensor peak
    memory: float  # of the datasheet memory bandwidth
    t_step: float  # s per step outside the kernels, with CUDA graphs
    # The share of the one-way NVLink bandwidth a tensor-parallel all-reduce reaches on this
    # generation's NVLink, where it differs from the table's shared `link` (the link's own
    # latency and protocol overheads differ by generation). None: `link`. How much data the
    # all-reduce moves per GPU (a ring's, or less where the switch reduces) is `link_traffic`.
    link: float | None = None


@dataclass(frozen=True, slots=True)
class EfficiencyTable:
    generations: dict[str, Efficiency]
    default: Efficiency  # a GPU of no known generation
    fp8_gemm: float  # fp8 GEMMs reach this fraction of the fp8 peak relative to gemm's of 16-bit
    attention: float  # attention kernels' efficiency relative to the GEMMs'
    t_row: float  # s per sampled row on the host (detokenization, streaming)
    t_logit: float  # s per sampled row and vocabulary entry (sampler over float32 logits)
    allreduce_nvlink_s: float  # latency of one small all-reduce over NVLink
    allreduce_pcie_s: float  # ... over PCIe, a ring of 8 GPUs (fewer: fewer hops)
    link: float  # fraction of the one-way NVLink bandwidth a ring all-reduce reaches
    # ... of the one-way PCIe bandwidth: much less than NVLink's, because PCIe traffic between
    # GPUs crosses the host's bridges and memory (see DEFAULTS)
    link_pcie: float = 0.55
    # s per layer and step: the fixed cost of a layer's kernels (launch, minimum kernel time)
    t_layer: float = 0.0
    # ... added without CUDA graphs (vLLM's --enforce-eager): every kernel launched from Python
    # each step. See DEFAULTS for the measurement it comes from.
    t_layer_eager: float = 3.4e-4
    # 0: a kernel takes the larger of its compute and memory times; p > 0: their p-norm (below
    # the ridge's corner, as measured kernels are)
    roofline_p: float = 0.0
    # s per request on the HTTP serving path, serial beside the engine: the API server's parsing,
    # chat template and tokenization and the benchmark client's own work (see simulate._FrontEnd).
    # Offline runs (the engine's Python API) do not pay it.
    t_request_http: float = 0.0
    basis: str = "default efficiencies"
    fitted_on: list[str] = field(default_factory=list)  # published case ids
    # Other engines' kernels relative to vLLM's (ours follow vLLM's design): a factor on the
    # GEMM (and so attention) efficiency, fitted on their published cases; 1 = vLLM. Memory-bound
    # decode reads the same bytes in any engine, so the bandwidth efficiency is the GPU's.
    # A key "engine/generation" (tensorrt-llm/hopper) is that engine on one chip family and
    # takes precedence over the plain key: another engine's kernels are not ahead of vLLM's by
    # the same margin on every tensor-core generation (TensorRT-LLM's own Hopper GEMM and
    # attention kernels against vLLM's; on Ampere both run cuBLAS/FlashAttention-class kernels).
    engines: dict[str, float] = field(default_factory=dict)
    # ... and a factor on their fixed costs (t_step, t_layer): a C++ runtime with fused kernels
    # (TensorRT-LLM) pays less per step and per layer than vLLM's Python loop; 1 = vLLM's.
    engine_overheads: dict[str, float] = field(default_factory=dict)

    def of(self, gpu: GpuSpec) -> Efficiency:
        return self.generations.get(GENERATION.get(gpu.name, ""), self.default)

    def coefficients(
        self, gpu: GpuSpec, dtype: str, tp: int = 1, engine: str = "vllm", eager: bool = False
    ) -> PerfCoefficients:
        """The step-time coefficients of one GPU of a tp group serving weights of `dtype`;
        eager: without CUDA graphs (each layer's kernels launched from the host every step).
        fp8 and int8 weights use the fp8/int8 tensor cores where the GPU has them; int4 and fp8
        on older GPUs are weight-only (dequantized to 16-bit for the GEMM)."""
        eff = self.of(gpu)
        generation = GENERATION.get(gpu.name, "")
        factor = engine_factor(self.engines, engine, generation)
        fixed = engine_factor(self.engine_overheads, engine, generation)
        eff = replace(eff, gemm=min(eff.gemm * factor, 1.0), t_step=eff.t_step * fixed)
        nvlink_share = self.link if eff.link is None else eff.link
        low_precision = dtype in ("fp8", "int8") and gpu.fp8_tflops
        peak = (gpu.fp8_tflops if low_precision else gpu.bf16_tflops) * 1e12
        gemm = eff.gemm * (self.fp8_gemm if low_precision else 1.0)
        nvlink = gpu.interconnect.lower().replace(" ", "").startswith(NVLINK_PREFIX)
        one_way = (gpu.interconnect_gbps or 0) * 1e9 / 2  # catalogue: both directions
        share = nvlink_share if nvlink else self.link_pcie
        return PerfCoefficients(
            k_compute=1.0 / (gemm * peak),
            k_memory=1.0 / (eff.memory * gpu.bandwidth_gbps * 1e9),
            t_step=eff.t_step,
            t_row=self.t_row,
            basis=f"datasheet estimate ({gpu.name}, {self.basis})",
            # Attention runs in 16-bit whatever the weights are.
            k_attention=1.0 / (eff.gemm * self.attention * gpu.bf16_tflops * 1e12),
            t_logit=self.t_logit,
            t_layer=self.t_layer * fixed + (self.t_layer_eager if eager else 0.0),
            roofline_p=self.roofline_p,
            t_allreduce=allreduce_latency(self, nvlink, tp),
            k_link=link_traffic(gpu, tp) / (share * one_way) if tp > 1 and one_way else 0.0,
        )

    def to_json(self) -> dict:
        return asdict(self)


def engine_factor(factors: dict[str, float], engine: str, generation: str) -> float:
    """An engine's factor on one chip family: its "engine/generation" key, else its plain key,
    else 1 (vLLM's own)."""
    key = engine_key(engine)
    return factors.get(f"{key}/{generation}", factors.get(key, 1.0))


# Interconnects whose switches reduce (NVLink SHARP on the third-generation NVSwitch of HGX
# H100/H200 boards, NCCL's NVLS algorithm, chosen by NCCL's tuner for large messages there).
IN_SWITCH_REDUCTION = ("nvlink4", "nvlink5")


def link_traffic(gpu: GpuSpec, tp: int) -> float:
    """The time of a tp-group all-reduce relative to a ring's, at the same link speed. A ring sends
    and receives 2 (tp - 1) / tp of the message per GPU (what ModelCosts counts). Where the switch
    reduces, each GPU sends its data into the switch once and reads the reduced result once:
    about the message itself, tp / (2 (tp - 1)) of the ring's bytes (the same at tp 2, 4/7 at
    tp 8). The A100's NVLink 3 switches cannot reduce, nor can PCIe."""
    interconnect = gpu.interconnect.lower().replace(" ", "")
    if tp <= 1 or not interconnect.startswith(IN_SWITCH_REDUCTION):
        return 1.0
    return tp / (2 * (tp - 1))


def allreduce_latency(table: EfficiencyTable, nvlink: bool, tp: int) -> float:
    """One small all-reduce's latency in a tp group. Over NVLink engines use a one-shot custom
    all-reduce (every GPU reads the others' buffers at once): one latency whatever the group's
    size. Over PCIe it is NCCL's ring, whose 2 (tp - 1) steps each pay a hop's latency: the
    table's figure is for 8 GPUs (as measured), scaled by the hops."""
    if tp <= 1:
        return 0.0
    if nvlink:
        return table.allreduce_nvlink_s
    return table.allreduce_pcie_s * (tp - 1) / (PCIE_LATENCY_GPUS - 1)


PCIE_LATENCY_GPUS = 8  # allreduce_pcie_s is the latency of a ring of this many GPUs


# Before any fit: fractions well-tuned engines are commonly said to reach (dense GEMMs at 60% of
# the 16-bit peak, decode at 75% of the bandwidth), 4 ms of host overhead per step, fp8 at the
# same fraction as 16-bit, attention at the GEMMs' efficiency, no sampler or NVLink all-reduce
# latency terms, a measured PCIe all-reduce latency, and the ring at full link bandwidth. They
# were the planner's only numbers before the published fit; they are kept as the fallback and as
# the fit's starting point.
DEFAULTS = EfficiencyTable(
    generations={},
    default=Efficiency(gemm=0.6, memory=0.75, t_step=0.004),
    fp8_gemm=1.0,
    attention=1.0,
    t_row=0.0,
    t_logit=0.0,
    allreduce_nvlink_s=0.0,
    # One small all-reduce over PCIe: 42.14 us for 8 bytes on 8 RTX 4090s (NCCL all_reduce_perf,
    # out-of-place; NVIDIA/nccl issue #1530). Published serving results with TP over PCIe are
    # too few to fit it.
    allreduce_pcie_s=42e-6,
    link=1.0,
    # A ring all-reduce over PCIe reaches busbw 35 GB/s on 4 GPUs and 28 GB/s on 8 of PCIe 5.0
    # x16 (64 GB/s one way): 0.55 and 0.44 (NVIDIA/nccl#1639, 8x RTX 5090; the NCCL maintainer:
    # "On PCI systems, the performance you get is usually determined by the bandwidth your CPU
    # and memory can deliver").
    link_pcie=0.55,
    # Eager decode of Qwen2.5-Omni-7B's thinker (Qwen2.5-7B's 28 layers) on A800 80GB (A100
    # class): TPOT ~22-23 ms eager, ~13 ms with CUDA graphs (vllm-project/vllm-omni#7960,
    # 2026-09-22): (22.5 - 13) ms / 28 layers. One published pair; no case fits it.
    t_layer_eager=3.4e-4,
)

_BOUNDS = {"gemm": (0.01, 1.0), "memory": (0.01, 1.0), "t_step": (0.0, 1.0), "link": (0.01, 1.0)}
EFFICIENCY_FIELDS = ("gemm", "memory", "t_step")  # every generation has them; link is optional
_SHARED_BOUNDS = {
    "fp8_gemm": (0.01, 2.0),
    "attention": (0.01, 2.0),
    "t_row": (0.0, 1.0),
    "t_logit": (0.0, 1e-3),
    "allreduce_nvlink_s": (0.0, 1.0),
    "allreduce_pcie_s": (0.0, 1.0),
    "link": (0.01, 1.0),
    "link_pcie": (0.01, 1.0),
    "t_layer": (0.0, 1e-2),
    "t_layer_eager": (0.0, 1e-2),
    "roofline_p": (0.0, 100.0),
    "t_request_http": (0.0, 1.0),
}


def engine_key(engine: str) -> str:
    """ "TensorRT-LLM (Triton tensorrtllm_backend)" -> "tensorrt-llm"; vLLM forks count as vLLM;
    "vllm-v0" (vLLM before 0.8, see published.engine_of) stays itself."""
    key = (engine.split() or ["vllm"])[0].lower()
    if key == VLLM_V0:
        return key
    return "vllm" if key.endswith("vllm") else key


# vLLM before 0.8 (its V0 engine): the same kernels as V1 (cuBLAS GEMMs, FlashAttention), so no
# GEMM factor of its own, but a Python step loop without V1's persistent batch and piecewise
# CUDA graphs around torch.compile: its own factor on the fixed costs.
VLLM_V0 = "vllm-v0"


def load_table(path: Path | None = None) -> EfficiencyTable:
    """The fitted table (default: the committed one), every field checked; DEFAULTS when the
    default file does not exist."""
    if path is None:
        if not TABLE_PATH.exists():
            return DEFAULTS
        path = TABLE_PATH
    data = Fields.of(read_json(path), path)

    def efficiency(f: Fields) -> Efficiency:
        link = f.number("link", *_BOUNDS["link"], None) if "link" in f.data else None
        return Efficiency(**{k: f.number(k, *_BOUNDS[k]) for k in EFFICIENCY_FIELDS}, link=link)

    gens = data.mapping("generations")
    generations = {name: efficiency(gens.mapping(name)) for name in gens.data}
    # A table written before a field existed takes that field's default.
    shared = {
        k: data.number(k, *bounds, getattr(DEFAULTS, k)) for k, bounds in _SHARED_BOUNDS.items()
    }
    engines = data.mapping("engines") if "engines" in data.data else Fields.of({}, path)
    fixed = data.mapping("engine_overheads") if "engine_overheads" in data.data else None
    return EfficiencyTable(
        generations=generations,
        default=efficiency(data.mapping("default")),
        basis=data.text("basis") or "",
        fitted_on=[str(x) for x in data.data.get("fitted_on", [])],
        engines={str(k): engines.number(k, 0.01, 10.0) for k in engines.data},
        engine_overheads={str(k): fixed.number(k, 0.01, 10.0) for k in fixed.data} if fixed else {},
        **shared,
    )


def save_table(table: EfficiencyTable, path: Path) -> None:
    path.write_text(json.dumps(table.to_json(), indent=1) + "\n")


# --- the fit's view: a table as a vector of free parameters --------------------------------


def parameter_names(
    generations: tuple[str, ...] = GENERATIONS,
    engines: tuple[str, ...] = (),
    links: tuple[str, ...] = (),
) -> list[str]:
    """The fit's free parameters: each generation's fractions, the shared terms, the NVLink share
    of each of `links` (generations with their own), and for each of `engines` ("engine" or
    "engine/generation" keys; vLLM's own are the reference) a GEMM factor and a fixed-cost
    factor (vLLM V0: the fixed costs only, its kernels are vLLM's)."""
    names = [f"{g}.{k}" for g in generations for k in EFFICIENCY_FIELDS]
    names += [f"{g}.link" for g in links]
    others = [e for e in engines if e.split("/")[0] != "vllm"]
    return (
        names
        + list(_SHARED_BOUNDS)
        + [f"engine:{e}" for e in others if e.split("/")[0] != VLLM_V0]
        + [f"engine_overhead:{e}" for e in others]
    )


def is_parameter(name: str) -> bool:
    """Whether a table has a parameter of this name ("hopper.link", "t_layer",
    "engine:tensorrt-llm/hopper"), whatever the cases."""
    if name.startswith(("engine:", "engine_overhead:")):
        return bool(name.partition(":")[2])
    if "." in name:
        generation, _, key = name.partition(".")
        return generation in GENERATIONS and key in _BOUNDS
    return name in _SHARED_BOUNDS


def bounds_of(name: str) -> tuple[float, float]:
    if name.startswith(("engine:", "engine_overhead:")):
        return (0.01, 10.0)
    key = name.split(".")[-1]
    return _BOUNDS[key] if "." in name else _SHARED_BOUNDS[key]


def get(table: EfficiencyTable, name: str) -> float:
    """A parameter's value; one the table does not set on its own is what applies to it (an
    engine on one generation: the engine's plain factor; a generation's link: the shared one)."""
    for prefix, factors in (
        ("engine:", table.engines),
        ("engine_overhead:", table.engine_overheads),
    ):
        if name.startswith(prefix):
            engine, _, generation = name.removeprefix(prefix).partition("/")
            return factors.get(f"{engine}/{generation}", factors.get(engine, 1.0))
    if "." in name:
        gen, key = name.split(".")
        value = getattr(table.generations.get(gen, table.default), key)
        return table.link if value is None and key == "link" else value
    return getattr(table, name)


def with_values(table: EfficiencyTable, values: dict[str, float]) -> EfficiencyTable:
    generations = dict(table.generations)
    engines = dict(table.engines)
    fixed = dict(table.engine_overheads)
    shared: dict = {}
    for name, value in values.items():
        if not math.isfinite(value):
            raise ValueError(f"{name} = {value}")
        if name.startswith("engine:"):
            engines[name.removeprefix("engine:")] = value
        elif name.startswith("engine_overhead:"):
            fixed[name.removeprefix("engine_overhead:")] = value
        elif "." in name:
            gen, key = name.split(".")
            generations[gen] = replace(generations.get(gen, table.default), **{key: value})
        else:
            shared[name] = value
    return replace(
        table, generations=generations, engines=engines, engine_overheads=fixed, **shared
    )
