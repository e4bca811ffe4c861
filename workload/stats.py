"""What a trace asks of a server: `nightshift workload stats`.

Percentiles interpolate linearly between order statistics (numpy's default). The prefix-reuse
ratio is the fraction of all prompt blocks (hash_ids, requests in timestamp order) whose id already
appeared earlier in the trace: the block hit rate of a prefix cache that never evicts. The
log-normal fit is the maximum-likelihood one (mean and standard deviation of log length, zero
lengths left out), with the Kolmogorov-Smirnov distance between the lengths and the fit."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from workload.trace import TraceRecord


@dataclass(slots=True)
class LengthStats:
    min: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int


@dataclass(slots=True)
class LogNormalFit:
    mu: float  # mean of log length
    sigma: float  # standard deviation of log length
    ks: float  # sup |empirical CDF - fitted CDF|
    n: int  # lengths fitted (the positive ones)


@dataclass(slots=True)
class GroupStats:
    count: int
    input: LengthStats
    output: LengthStats
    input_fit: LogNormalFit | None
    output_fit: LogNormalFit | None


@dataclass(slots=True)
class TraceStats:
    count: int
    duration_s: float
    rate_per_s: float | None  # None for a batch (all requests at one time)
    blocks: int
    reused_blocks: int
    prefix_reuse: float | None  # None when the trace names no blocks
    overall: GroupStats
    kinds: dict[str, GroupStats] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def length_stats(values: Sequence[int]) -> LengthStats:
    data = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return LengthStats(
        int(data.min()), float(data.mean()), float(p50), float(p90), float(p99), int(data.max())
    )


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in z]))


def ks_distance(samples: np.ndarray, mu: float, sigma: float) -> float:
    """Kolmogorov-Smirnov statistic of positive samples against LogNormal(mu, sigma)."""
    x = np.sort(samples)
    n = len(x)
    fitted = _normal_cdf((np.log(x) - mu) / sigma)
    ranks = np.arange(1, n + 1)
    return float(max(np.max(ranks / n - fitted), np.max(fitted - (ranks - 1) / n)))


def fit_lognormal(values: Sequence[float]) -> LogNormalFit | None:
    """MLE fit to the positive values; None with fewer than two or no spread."""
    data = np.asarray(values, dtype=np.float64)
    data = data[data > 0]
    if len(data) < 2:
        return None
    logs = np.log(data)
    mu, sigma = float(logs.mean()), float(logs.std())
    if sigma == 0.0:
        return None
    return LogNormalFit(mu, sigma, ks_distance(data, mu, sigma), len(data))


def group_stats(records: Sequence[TraceRecord]) -> GroupStats:
    inputs = [r.input_length for r in records]
    outputs = [r.output_length for r in records]
    return GroupStats(
        len(records),
        length_stats(inputs),
        length_stats(outputs),
        fit_lognormal(inputs),
        fit_lognormal(outputs),
    )


def prefix_reuse(records: Sequence[TraceRecord]) -> tuple[int, int]:
    """(all prompt blocks, blocks whose id appeared earlier), requests in timestamp order."""
    seen: set[int] = set()
    total = reused = 0
    for record in sorted(records, key=lambda r: r.timestamp):
        for block in record.hash_ids:
            total += 1
            if block in seen:
                reused += 1
            else:
                seen.add(block)
    return total, reused


def trace_stats(records: Sequence[TraceRecord]) -> TraceStats:
    if not records:
        raise ValueError("the trace has no requests")
    stamps = [r.timestamp for r in records]
    duration = (max(stamps) - min(stamps)) / 1000
    blocks, reused = prefix_reuse(records)
    kinds = sorted({r.kind for r in records if r.kind is not None})
    return TraceStats(
        count=len(records),
        duration_s=duration,
        rate_per_s=len(records) / duration if duration > 0 else None,
        blocks=blocks,
        reused_blocks=reused,
        prefix_reuse=reused / blocks if blocks else None,
        overall=group_stats(records),
        kinds={k: group_stats([r for r in records if r.kind == k]) for k in kinds},
    )


def _column(group: GroupStats, side: str) -> list[str]:
    lengths: LengthStats = getattr(group, side)
    fit: LogNormalFit | None = getattr(group, f"{side}_fit")
    cells = [str(lengths.min), f"{lengths.mean:.1f}"]
    cells += [f"{v:g}" for v in (lengths.p50, lengths.p90, lengths.p99)] + [str(lengths.max)]
    return cells + ([f"{fit.mu:.3f}", f"{fit.sigma:.3f}", f"{fit.ks:.3f}"] if fit else ["-"] * 3)


def format_table(stats: TraceStats) -> str:
    """A summary line, then token lengths: one row per statistic, an input and an output column
    per group (all requests, then each kind)."""
    rate = f"{stats.rate_per_s:.3f} req/s" if stats.rate_per_s else "batch (one arrival time)"
    reuse = f"{stats.prefix_reuse:.1%}" if stats.prefix_reuse is not None else "-"
    head = (
        f"{stats.count} requests over {stats.duration_s:.1f} s, {rate}; "
        f"prefix reuse {reuse} of {stats.blocks} blocks"
    )
    groups = {"all": stats.overall, **stats.kinds}
    names = ["tokens", "min", "mean", "p50", "p90", "p99", "max", "lognormal mu", "sigma", "KS"]
    columns = [names]
    for name, group in groups.items():
        for side, label in (("input", "in"), ("output", "out")):
            columns.append([f"{name} {label} ({group.count})", *_column(group, side)])
    widths = [max(len(cell) for cell in column) for column in columns]
    rows = [
        "  ".join(
            column[i].ljust(w) if c == 0 else column[i].rjust(w)
            for c, (column, w) in enumerate(zip(columns, widths))
        )
        for i in range(len(names))
    ]
    return "\n".join([head, *rows])
