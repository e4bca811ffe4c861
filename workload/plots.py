"""Pictures of a trace's token lengths (`workload stats --plots DIR`): a histogram on log-spaced
bins with the fitted log-normal density, and the empirical CDF, input and output side by side,
one series per kind. PNG through matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workload.stats import fit_lognormal
from workload.trace import TraceRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BINS = 40
SIDES = (("input_length", "input tokens"), ("output_length", "output tokens"))


def _groups(records: Sequence[TraceRecord]) -> dict[str, list[TraceRecord]]:
    """Series to draw per side: each kind, or all requests when the trace has no kinds."""
    kinds = sorted({r.kind for r in records if r.kind is not None})
    if not kinds:
        return {"all": list(records)}
    return {k: [r for r in records if r.kind == k] for k in kinds}


def _lengths(group: list[TraceRecord], attr: str) -> np.ndarray:
    return np.array([getattr(r, attr) for r in group], dtype=np.float64)


def _histogram(ax: Axes, values: np.ndarray, label: str) -> None:
    """Fraction of requests per log-spaced bin; the fit drawn as the same fraction per bin."""
    positive = values[values > 0]
    if len(positive) == 0:
        return
    low, high = positive.min(), max(positive.max(), positive.min() + 1)
    bins = np.geomspace(low, high, BINS + 1)
    weights = np.full(len(positive), 1 / len(values))
    ax.hist(positive, bins=bins, weights=weights, alpha=0.45, label=f"{label} (n={len(values)})")
    fit = fit_lognormal(positive)
    if fit is not None:
        x = np.geomspace(low, high, 200)
        width = np.log(high / low) / BINS  # every bin spans the same width in log length
        z = (np.log(x) - fit.mu) / fit.sigma
        per_bin = np.exp(-(z**2) / 2) / (fit.sigma * np.sqrt(2 * np.pi)) * width
        ax.plot(x, per_bin, "--", label=f"log-normal mu={fit.mu:.2f} sigma={fit.sigma:.2f}")


def _cdf(ax: Axes, values: np.ndarray, label: str) -> None:
    x = np.sort(values)
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{label} (n={len(x)})")


def plot_lengths(records: Sequence[TraceRecord], out_dir: Path, title: str = "") -> list[Path]:
    """Write lengths_hist.png and lengths_cdf.png into out_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(exist_ok=True)  # its folder must exist (workload/output_file.py)
    groups = _groups(records)
    paths = []
    for name, draw, ylabel in (("hist", _histogram, "fraction per bin"), ("cdf", _cdf, "fraction")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
        for ax, (attr, xlabel) in zip(axes, SIDES):
            for label, group in groups.items():
                draw(ax, _lengths(group, attr), label)
            ax.set_xscale("log")
            ax.set(xlabel=xlabel, ylabel=ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{title} token lengths".strip())
        path = out_dir / f"lengths_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
