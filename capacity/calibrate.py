"""Fit the performance model's coefficients to a step profile (`--profile-path` of the engine).

Each profiled step gives a shape (tokens, sampled rows, attention pairs, context) and a measured
cycle time: the step itself plus the serving loop's gap before the next step when work was
waiting. The model (`perf.py`) is max(k_compute GEMM FLOPs, k_memory weight bytes) +
max(k_attention attention FLOPs, k_memory KV bytes) + t_step + t_row rows: piecewise linear, so
given which ceiling binds each of a step's two rooflines, the coefficients are a linear
least-squares fit. `fit` alternates the two - assign each step's rooflines to the ceiling that
binds under the current coefficients, refit - until the assignment stops changing (a k-plane
regression)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from capacity.perf import ModelCosts, PerfCoefficients, PerfModel, StepShape
from workload.input_file import Fields, parse_json, read_json, text_lines

MAX_ITERATIONS = 50


class CalibrationError(ValueError):
    """The profile cannot be fitted (too few steps); a malformed one is a BadInputFile."""


@dataclass(frozen=True, slots=True)
class Sample:
    shape: StepShape
    seconds: float


@dataclass(frozen=True, slots=True)
class Calibration:
    coefficients: PerfCoefficients
    steps: int
    rmse_s: float  # per step
    mean_abs_error_pct: float  # per step, relative to the measured time
    total_error_pct: float  # sum of predicted vs measured step times
    compute_bound_steps: int
    machine: str

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> Calibration:
        return Calibration(**{**data, "coefficients": PerfCoefficients(**data["coefficients"])})


# A step's counts and seconds, bounded so that a corrupt profile is an error, not a fit to 1e300.
MAX_STEP_COUNT = 2**53
MAX_STEP_S = 3600.0
PROFILE_FIELDS = (
    "step", "wall_s", "num_batched_tokens", "sampled_requests", "attention_pairs", "context_tokens"
)  # fmt: skip


def load_samples(path: Path) -> list[Sample]:
    """Steps of a profile with their cycle times (step + the gap before the next busy step).
    A bad line raises BadInputFile naming the file and the line."""
    steps: list[tuple[int, int, float, float, StepShape]] = []  # line, step, wall, gap, shape
    for number, line in text_lines(path):
        if not line.strip():
            continue
        rec = Fields.of(parse_json(line.rstrip("\r\n"), path, number), path, number)
        if missing := [k for k in PROFILE_FIELDS if k not in rec.data]:
            raise rec.error(f"the step lacks {missing}; record the profile with this version")
        count = {
            key: rec.integer(key, 0, MAX_STEP_COUNT)
            for key in ("num_batched_tokens", "sampled_requests", "attention_pairs")
        }
        shape = StepShape(
            count["num_batched_tokens"],
            count["sampled_requests"],
            count["attention_pairs"],
            rec.integer("context_tokens", 0, MAX_STEP_COUNT),
        )
        # A step takes time: a zero would divide the fit's relative error by zero.
        wall = rec.number("wall_s", 0, MAX_STEP_S)
        if wall <= 0:
            raise rec.error(f"wall_s must be positive, not {wall:g}")
        gap = rec.number("gap_s", 0, MAX_STEP_S, 0.0)
        steps.append((number, rec.integer("step", 0, MAX_STEP_COUNT), wall, gap, shape))
    samples = []
    for i, (_, step, wall, _, shape) in enumerate(steps):
        follower = steps[i + 1] if i + 1 < len(steps) else None
        gap = follower[3] if follower and follower[1] == step + 1 else 0.0
        samples.append(Sample(shape, wall + gap))
    return samples


def load_calibration(path: Path) -> Calibration:
    """A calibration file (`capacity calibrate -o`), every field checked."""
    data = Fields.of(read_json(path), path)
    c = data.mapping("coefficients")
    coefficients = PerfCoefficients(
        *(c.number(key, 0, math.inf) for key in ("k_compute", "k_memory", "t_step", "t_row")),
        basis=c.text("basis") or "",
        k_attention=c.number("k_attention", 0, math.inf, None),
        t_logit=c.number("t_logit", 0, math.inf, 0.0),
        t_allreduce=c.number("t_allreduce", 0, math.inf, 0.0),
        k_link=c.number("k_link", 0, math.inf, 0.0),
    )
    if not (coefficients.k_compute or coefficients.k_memory or coefficients.t_step):
        raise c.error("k_compute, k_memory and t_step are all 0: steps would take no time")
    return Calibration(
        coefficients=coefficients,
        steps=data.integer("steps", 0, MAX_STEP_COUNT),
        rmse_s=data.number("rmse_s", 0, math.inf),
        mean_abs_error_pct=data.number("mean_abs_error_pct", 0, math.inf),
        total_error_pct=data.number("total_error_pct", -math.inf, math.inf),
        compute_bound_steps=data.integer("compute_bound_steps", 0, MAX_STEP_COUNT),
        machine=data.text("machine") or "",
    )


def fit(samples: list[Sample], costs: ModelCosts, machine: str = "this machine") -> Calibration:
    if len(samples) < 8:
        raise CalibrationError(f"{len(samples)} steps are too few to fit five coefficients")
    gemm = np.array([s.shape.gemm_flops(costs) for s in samples])
    weights = np.full(len(samples), float(costs.weight_bytes))
    attention = np.array([s.shape.attention_flops(costs) for s in samples])
    kv = np.array([s.shape.kv_bytes(costs) for s in samples])
    rows = np.array([s.shape.sampled_rows for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples])
    # Start from "the side with more work per unit of its ceiling binds": the medians' ratios.
    flops_scale = np.median(y) / max(np.median(gemm + attention), 1.0)
    bytes_scale = np.median(y) / max(np.median(weights + kv), 1.0)
    bound = (
        gemm * flops_scale >= weights * bytes_scale,
        attention * flops_scale >= kv * bytes_scale,
    )
    for _ in range(MAX_ITERATIONS):
        k_c, k_b, k_a, t_step, t_row = _solve(gemm, weights, attention, kv, rows, y, bound)
        # No step's attention was compute-bound: it keeps the GEMMs' coefficient.
        k_a = k_a if k_a > 0 else k_c
        new = (gemm * k_c >= weights * k_b, attention * k_a >= kv * k_b)
        if all(np.array_equal(x, z) for x, z in zip(new, bound)):
            break
        bound = new
    coefficients = PerfCoefficients(
        k_c, k_b, t_step, t_row, basis=f"calibrated on {machine}", k_attention=k_a
    )
    model = PerfModel(costs, coefficients)
    predicted = np.array([model.step_time(s.shape) for s in samples])
    error = predicted - y
    return Calibration(
        coefficients=coefficients,
        steps=len(samples),
        rmse_s=float(math.sqrt(np.mean(error**2))),
        mean_abs_error_pct=float(np.mean(np.abs(error) / y) * 100),
        total_error_pct=float((predicted.sum() - y.sum()) / y.sum() * 100),
        compute_bound_steps=int(bound[0].sum()),
        machine=machine,
    )


def _solve(
    gemm: np.ndarray,
    weights: np.ndarray,
    attention: np.ndarray,
    kv: np.ndarray,
    rows: np.ndarray,
    y: np.ndarray,
    bound: tuple[np.ndarray, np.ndarray],
) -> tuple[float, float, float, float, float]:
    """Least squares for (k_compute, k_memory, k_attention, t_step, t_row) with every coefficient
    >= 0, given which side of each roofline binds: a coefficient that comes out negative is fixed
    at 0 and the rest refitted."""
    gemm_bound, attention_bound = bound
    columns = [
        gemm * gemm_bound,
        weights * ~gemm_bound + kv * ~attention_bound,
        attention * attention_bound,
        np.ones_like(y),
        rows,
    ]
    active = [bool(np.any(c)) for c in columns]
    while True:
        index = [i for i, on in enumerate(active) if on]
        a = np.stack([columns[i] for i in index], axis=1)
        # Columns differ by many orders of magnitude (FLOPs vs 1): scale them for conditioning.
        norms = np.linalg.norm(a, axis=0)
        norms[norms == 0] = 1.0
        solution = np.linalg.lstsq(a / norms, y, rcond=None)[0] / norms
        negative = [i for i, value in zip(index, solution) if value < 0]
        if not negative:
            break
        active[negative[0]] = False
    out = [0.0] * 5
    for i, value in zip(index, solution):
        out[i] = float(value)
    return out[0], out[1], out[2], out[3], out[4]
