"""PNG plots of a replay result (the JSON that `nightshift workload replay` writes), so that they
can be redrawn from the file: latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

_LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))


def plot_latency_cdfs(result: dict, path: Path) -> Path:
    requests = [r for r in result["requests"] if r.get("error_kind") is None]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title) in zip(axes, _LATENCIES):
        values = np.sort([r[key] * 1000.0 for r in requests if r.get(key) is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(np.percentile(values, q), color="grey", ls=style, lw=0.8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} ({len(values)} requests)")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(_title(result) + "  (dashed: median, dotted: p99)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(result: dict, path: Path) -> Path:
    timeline = result["summary"]["timeline"]
    values = timeline["output_tokens_per_s"]
    bin_s = timeline["bin_s"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    if values:
        ax.stairs(values, np.arange(len(values) + 1) * bin_s)  # the last bin may be partial
        mean = result["summary"].get("output_throughput")
        if mean:
            ax.axhline(mean, color="grey", ls="--", lw=0.8, label=f"mean {mean:.1f} tok/s")
            ax.legend(loc="upper right")
    ax.set_xlabel("seconds since the replay's start")
    ax.set_ylabel(f"output tokens/s ({bin_s:g} s bins)")
    ax.set_title(_title(result), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_replay(result: dict, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(exist_ok=True)  # its folder must exist (workload/output_file.py)
    return [
        plot_latency_cdfs(result, out_dir / "latency_cdf.png"),
        plot_throughput(result, out_dir / "throughput.png"),
    ]


def _title(result: dict) -> str:
    cfg = result.get("config", {})
    return f"{cfg.get('model', '?')} @ {cfg.get('base_url', '?')}, mode {cfg.get('mode', '?')}"
