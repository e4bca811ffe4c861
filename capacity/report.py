"""`nightshift capacity report`: the planner's answers as one HTML page (plots embedded) and a
Markdown file (plots beside it). Every figure says what it is: measured, calibrated estimate,
datasheet estimate, or pending a GPU measurement."""

from __future__ import annotations

import base64
import dataclasses
import io
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from capacity.calibrate import Calibration
from capacity.gpus import GpuSpec
from capacity.memory import (
    CUDA_CONTEXT_BYTES,
    CUDA_GRAPH_BYTES_PER_LAYER,
    GIB,
    NCCL_NVLINK_BYTES,
    NCCL_PCIE_BYTES,
    NON_TORCH_BYTES,
    SAMPLER_FLOAT32_COPIES,
)
from capacity.model_specs import ModelSpec
from capacity.planner import (
    DAYS_PER_MONTH,
    LARGER_TPS,
    GpuPlan,
    PlanSettings,
    api_cost,
    plan_gpu,
    request_lengths,
)
from capacity.search import SearchResult, search_settings
from capacity.serve_command import serve_command
from workload.synth import synth_trace
from workload.trace import TraceRecord

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)  # papers per night, relative to the trace, for the plot

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("capacity", "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(slots=True)
class Report:
    model: ModelSpec
    trace_note: str
    trace: list[TraceRecord]
    settings: PlanSettings
    plans: list[GpuPlan]
    calibration: Calibration | None
    api_cost_per_night: float | None
    lengths: dict[str, int]
    scaling: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # gpu -> points
    generated_at: str = ""
    # With --search: per plan that fits, the grid of engine settings and the best point.
    searches: list[tuple[GpuPlan, SearchResult]] = field(default_factory=list)

    @property
    def papers(self) -> int:
        kinds = {r.kind for r in self.trace}
        return len(self.trace) // max(1, len(kinds - {None}) or 1)


def build_report(
    spec: ModelSpec,
    trace: list[TraceRecord],
    trace_note: str,
    gpus: list[GpuSpec],
    tps: list[int],
    settings: PlanSettings,
    calibration: Calibration | None = None,
    *,
    search: bool = False,
) -> Report:
    plans = [plan_gpu(spec, trace, gpu, tp, settings, calibration) for gpu in gpus for tp in tps]
    report = Report(
        model=spec,
        trace_note=trace_note,
        trace=trace,
        settings=settings,
        plans=plans,
        calibration=calibration,
        api_cost_per_night=api_cost(trace, settings),
        lengths=request_lengths(trace),
        generated_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
    report.scaling = _scaling(
        spec, trace, [p for p in plans if p.tp == tps[0]], settings, calibration
    )
    if search:
        report.searches = [
            (p, search_settings(spec, trace, p.gpu, p.tp, settings, calibration))
            for p in plans
            if p.sim is not None
        ]
    return report


def search_rows(report: Report) -> list[dict]:
    """Per plan searched: the asked settings' figures next to the best grid point's."""
    rows = []
    for plan, result in report.searches:
        best = result.best
        rows.append(
            {
                "gpu": plan.gpu.name,
                "tp": plan.tp,
                "asked": {
                    "max_num_seqs": report.settings.max_num_seqs,
                    "max_num_batched_tokens": report.settings.max_num_batched_tokens,
                    "gpus": plan.gpus,
                    "replica_makespan_s": plan.replica_makespan_s,
                    "output_tokens_per_s": plan.sim.output_tokens_per_s if plan.sim else None,
                },
                "best": None
                if best is None
                else {
                    "max_num_seqs": best.max_num_seqs,
                    "max_num_batched_tokens": best.max_num_batched_tokens,
                    "gpus": best.plan.gpus,
                    "replica_makespan_s": best.plan.replica_makespan_s,
                    "output_tokens_per_s": best.plan.sim.output_tokens_per_s,
                },
                "grid": [
                    {
                        "max_num_seqs": pt.max_num_seqs,
                        "max_num_batched_tokens": pt.max_num_batched_tokens,
                        "error": pt.plan.error,
                        "gpus": pt.plan.gpus if pt.fits else None,
                        "makespan_s": pt.plan.sim.makespan_s if pt.fits else None,
                        "replica_makespan_s": pt.plan.replica_makespan_s if pt.fits else None,
                    }
                    for pt in result.points
                ],
            }
        )
    return rows


def _scaling(
    spec: ModelSpec,
    trace: list[TraceRecord],
    plans: list[GpuPlan],
    settings: PlanSettings,
    calibration: Calibration | None,
) -> dict[str, list[tuple[int, float]]]:
    """Makespan on one replica as the column grows: the trace resampled at each scale."""
    points: dict[str, list[tuple[int, float]]] = {}
    single = PlanSettings(**{**_fields(settings), "deadline_s": None})
    for plan in plans:
        if plan.sim is None:
            continue
        series = []
        for scale in SCALES:
            papers = max(1, round(len(trace) / 2 * scale))
            scaled, _ = synth_trace(trace, papers, seed=1)
            sim = plan_gpu(spec, scaled, plan.gpu, plan.tp, single, calibration).sim
            if sim is not None:
                series.append((papers, sim.makespan_s))
        points[plan.gpu.name] = series
    return points


def _fields(settings: PlanSettings) -> dict:
    return {name: getattr(settings, name) for name in settings.__slots__}


def total_tokens_per_s(plan: GpuPlan) -> float | None:
    """Input and output tokens of the batch over its makespan (one replica's whole batch)."""
    sim = plan.sim
    if sim is None or sim.makespan_s <= 0:
        return None
    return sum(r.input_length + r.output_length for r in sim.requests) / sim.makespan_s


def requests_per_s(plan: GpuPlan) -> float | None:
    sim = plan.sim
    if sim is None or sim.makespan_s <= 0:
        return None
    return len(sim.requests) / sim.makespan_s


def assumptions(plan: GpuPlan) -> dict | None:
    """What the step times assume, as fractions of the datasheet peaks and seconds: the
    coefficients of the performance model for this GPU and tp."""
    c, hw = plan.coefficients, plan.hardware
    if c is None or hw is None:
        return None
    compute, memory = c.efficiencies(hw)
    return {
        "basis": c.basis,
        "peak_flops_per_s": hw.flops_per_s,  # the GEMMs' (fp8 tensor cores for fp8 weights)
        "peak_bytes_per_s": hw.bytes_per_s,
        "compute_efficiency": compute,
        "attention_efficiency": 1.0 / (c.attention * plan.gpu.bf16_tflops * 1e12),  # of bf16
        "memory_efficiency": memory,
        "t_step_s": c.t_step,
        "t_layer_s": c.t_layer,
        "t_row_s": c.t_row,
        "t_logit_s": c.t_logit,
        "t_allreduce_s": c.t_allreduce,
        "link_bytes_per_s": 1.0 / c.k_link if c.k_link > 0 else None,
        "t_request_http_s": plan.request_cost_s,
    }


def tp_note(plan: GpuPlan) -> str:
    """For a plan that does not fit: the smallest larger tensor-parallel size that does."""
    if plan.memory is not None or plan.error is None or plan.error.startswith("--max-model-len"):
        return ""
    if plan.fits_at_tp is not None:
        return f"Smallest TP that fits: {plan.fits_at_tp}."
    larger = [str(t) for t in LARGER_TPS if t > plan.tp]
    return f"No TP of {', '.join(larger)} fits either." if larger else ""


MEMORY_CONSTANTS = {  # capacity/memory.py's, each with its source there
    "cuda_context_bytes": CUDA_CONTEXT_BYTES,
    "non_torch_bytes": NON_TORCH_BYTES,
    "nccl_nvlink_bytes": NCCL_NVLINK_BYTES,
    "nccl_pcie_bytes": NCCL_PCIE_BYTES,
    "cuda_graph_bytes_per_layer": CUDA_GRAPH_BYTES_PER_LAYER,
    "sampler_float32_copies": SAMPLER_FLOAT32_COPIES,
}


def report_json(report: Report) -> dict:
    """Every table's figures, unrounded, for scripts (`capacity report --json FILE`). Times in
    seconds, memory in bytes, money in USD; each plan says how its times were obtained and what
    they assume."""
    requests = len(report.trace)
    plans = []
    for p in report.plans:
        entry: dict = {
            "gpu": p.gpu.name,
            "tp": p.tp,
            "error": p.error,
            "fits_at_tp": p.fits_at_tp,
            "basis": p.basis,
            "gpu_memory": {
                "datasheet_gb": p.gpu.memory_gb,
                "cuda_bytes": p.gpu.memory_bytes,
                "basis": p.gpu.memory_basis,
            },
        }
        if p.memory is not None:
            entry["memory"] = dataclasses.asdict(p.memory)
        if (assumed := assumptions(p)) is not None:
            entry["assumptions"] = assumed
        if p.sim is not None:
            entry |= {
                "replicas": p.replicas,
                "gpus": p.gpus,
                "makespan_s": p.sim.makespan_s,
                "replica_makespan_s": p.replica_makespan_s,
                "meets_deadline": (
                    report.settings.deadline_s is None
                    or p.replica_makespan_s <= report.settings.deadline_s
                ),
                "gpu_hours": p.gpu_hours,
                "price_per_gpu_hour_usd": p.gpu.price_per_hour,
                "cost_per_night_usd": p.cost_per_night,
                "cost_per_month_usd": p.cost_per_night * DAYS_PER_MONTH,
                "output_tokens_per_s": p.sim.output_tokens_per_s,
                "total_tokens_per_s": total_tokens_per_s(p),
                "requests_per_s": requests_per_s(p),
                "preemptions": p.sim.preemptions,
                "latency_s": p.latency,
            }
            command = serve_command(p, report.settings, report.model.name)
            entry["serve_command"] = {"args": command.args, "caveats": command.caveats}
        plans.append(entry)
    return {
        "model": report.model.name,
        "workload": report.trace_note,
        "requests": requests,
        "input_tokens": sum(r.input_length for r in report.trace),
        "output_tokens": sum(r.output_length for r in report.trace),
        # tokens per hash_ids block of the trace (the prompts' sharing), not the KV block size
        "hash_block_size": report.trace[0].hash_block_size if report.trace else None,
        "settings": {
            **{
                k: v
                for k, v in _fields(report.settings).items()
                if k not in ("load", "speculation")
            },
            "load": dataclasses.asdict(report.settings.load),
            "speculation": (
                None
                if report.settings.speculation is None
                else dataclasses.asdict(report.settings.speculation)
            ),
        },
        "api_cost_per_night_usd": report.api_cost_per_night,
        "api_cost_per_month_usd": (
            None if (api := report.api_cost_per_night) is None else api * DAYS_PER_MONTH
        ),
        "request_length_tokens": report.lengths,
        "memory_constants": MEMORY_CONSTANTS,
        "plans": plans,
        "scaling_makespan_s": report.scaling,
        "search": search_rows(report),
    }


def render(report: Report, out: Path) -> list[Path]:
    """Write out (.html or .md; the other one beside it) and the plots; returns the paths."""
    out = Path(out)
    html_path, md_path = out.with_suffix(".html"), out.with_suffix(".md")
    plots = {"scaling": _plot_scaling(report), "kv": _plot_kv(report)}
    written = []
    for name, png in plots.items():
        path = out.with_name(f"{out.stem}-{name}.png")
        path.write_bytes(png)
        written.append(path)
    context = _context(report)
    html_path.write_text(
        _ENV.get_template("report.html").render(
            **context, plots={k: base64.b64encode(v).decode() for k, v in plots.items()}
        )
    )
    md_path.write_text(
        _ENV.get_template("report.md").render(
            **context, plots={k: p.name for k, p in zip(plots, written)}
        )
    )
    return [html_path, md_path, *written]


def _context(report: Report) -> dict:
    return {
        "r": report,
        "assumed": assumptions,
        "total_tps": total_tokens_per_s,
        "rps": requests_per_s,
        "tp_note": tp_note,
        "serve": lambda p: serve_command(p, report.settings, report.model.name),
        "searched": search_rows(report),
        "mem": MEMORY_CONSTANTS,
        "pct": lambda x: "n/a" if x is None else f"{x * 100:.0f}%",
        "num": lambda x, f="%.0f": "n/a" if x is None else f % x,
        "gib": lambda n: f"{n / GIB:.2f}",
        "hours": _duration,
        "money": lambda x: "n/a" if x is None else f"${x:,.2f}",
        "month": DAYS_PER_MONTH,
        "ms": lambda s: "n/a" if s is None else f"{s * 1000:.0f}",
    }


def _duration(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _plot_scaling(report: Report) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in report.scaling.items():
        if points:
            ax.plot([p for p, _ in points], [m / 60 for _, m in points], marker="o", label=name)
    if report.settings.deadline_s:
        ax.axhline(report.settings.deadline_s / 60, color="grey", linestyle="--", label="deadline")
    ax.set_xlabel("papers per night")
    ax.set_ylabel("makespan on one GPU group (min)")
    ax.set_title(f"{report.model.name}: batch makespan (simulated; estimates)")
    _legend(ax)
    return _png(fig)


def _plot_kv(report: Report) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for plan in report.plans:
        if plan.sim is not None and plan.sim.kv_usage:
            times, usage = zip(*plan.sim.kv_usage)
            ax.plot(
                [t / 60 for t in times],
                [u * 100 for u in usage],
                label=f"{plan.gpu.name} tp={plan.tp}",
            )
    ax.set_xlabel("time into the batch (min)")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_title("KV cache usage over tonight's batch (simulated)")
    _legend(ax, fontsize="small")
    return _png(fig)


def _legend(ax: Axes, **options: object) -> None:
    """A legend, or where no GPU fits (nothing drawn) a note: matplotlib warns on stderr about
    a legend with no entries."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**options)
    else:
        ax.text(0.5, 0.5, "no GPU fits", ha="center", va="center", transform=ax.transAxes)


def _png(fig: Figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
