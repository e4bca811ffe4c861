"""Fit the performance model's coefficients to a step profile (`--profile-path` of the engine).

Each profiled step gives a shape (tokens, sampled rows, attention pairs, context) and a measured
cycle time: the step itself plus the serving loop's gap before the next step when work was
waiting. The model is max(k_compute * FLOPs, k_memory * bytes) + t_step + t_row * rows, piecewise
linear: given which ceiling binds each step, the coefficients are a linear least-squares fit.
`fit` alternates the two - assign each step to the ceiling that binds under the current
coefficients, refit - until the assignment stops changing (a k-plane regression)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from capacity.perf import ModelCosts, PerfCoefficients, PerfModel, StepShape

MAX_ITERATIONS = 50


class CalibrationError(ValueError):
    """The profile cannot be fitted (missing, malformed, or too few steps)."""


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


def load_samples(path: Path) -> list[Sample]:
    """Steps of a profile with their cycle times (step + the gap before the next busy step)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read ({exc.strerror or exc})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}:{number}: not JSON ({exc.msg})") from None
    needed = ("wall_s", "num_batched_tokens", "sampled_requests", "attention_pairs")
    samples = []
    for i, rec in enumerate(records):
        if missing := [k for k in needed if k not in rec]:
            raise CalibrationError(
                f"{path}: step {i} lacks {missing}; record the profile with this version"
            )
        follower = records[i + 1] if i + 1 < len(records) else None
        gap = (
            follower.get("gap_s", 0.0)
            if follower and follower.get("step") == rec["step"] + 1
            else 0
        )
        shape = StepShape(
            rec["num_batched_tokens"],
            rec["sampled_requests"],
            rec["attention_pairs"],
            rec["context_tokens"],
        )
        samples.append(Sample(shape, rec["wall_s"] + gap))
    return samples


def fit(samples: list[Sample], costs: ModelCosts, machine: str = "this machine") -> Calibration:
    if len(samples) < 8:
        raise CalibrationError(f"{len(samples)} steps are too few to fit four coefficients")
    flops = np.array([s.shape.flops(costs) for s in samples])
    bytes_ = np.array([s.shape.bytes(costs) for s in samples])
    rows = np.array([s.shape.sampled_rows for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples])
    # Start from "the step with more work per unit of its ceiling binds": use the medians' ratio.
    scale = np.median(y) / max(np.median(flops), 1.0), np.median(y) / max(np.median(bytes_), 1.0)
    compute = flops * scale[0] >= bytes_ * scale[1]
    for _ in range(MAX_ITERATIONS):
        k_c, k_b, t_step, t_row = _solve(flops, bytes_, rows, y, compute)
        new = flops * k_c >= bytes_ * k_b
        if np.array_equal(new, compute):
            break
        compute = new
    coefficients = PerfCoefficients(k_c, k_b, t_step, t_row, basis=f"calibrated on {machine}")
    model = PerfModel(costs, coefficients)
    predicted = np.array([model.step_time(s.shape) for s in samples])
    error = predicted - y
    return Calibration(
        coefficients=coefficients,
        steps=len(samples),
        rmse_s=float(math.sqrt(np.mean(error**2))),
        mean_abs_error_pct=float(np.mean(np.abs(error) / y) * 100),
        total_error_pct=float((predicted.sum() - y.sum()) / y.sum() * 100),
        compute_bound_steps=int(compute.sum()),
        machine=machine,
    )


def _solve(
    flops: np.ndarray, bytes_: np.ndarray, rows: np.ndarray, y: np.ndarray, compute: np.ndarray
) -> tuple[float, float, float, float]:
    """Least squares for (k_compute, k_memory, t_step, t_row) with every coefficient >= 0: a
    coefficient that comes out negative is fixed at 0 and the rest refitted."""
    columns = [flops * compute, bytes_ * ~compute, np.ones_like(y), rows]
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
    out = [0.0] * 4
    for i, value in zip(index, solution):
        out[i] = float(value)
    return out[0], out[1], out[2], out[3]
