"""Calibration recovers known coefficients from synthetic profiles, and reads real ones."""

from __future__ import annotations

import json
import random

import pytest

from capacity.calibrate import CalibrationError, Sample, fit, load_samples
from capacity.perf import ModelCosts, PerfCoefficients, PerfModel, StepShape
from workload.input_file import BadInputFile

COSTS = ModelCosts(
    layer_params=106_000_000,
    lm_head_params=576 * 49152,
    weight_bytes=540_000_000,
    attention_flops_per_pair=4 * 30 * 9 * 64,
    kv_bytes_per_token=2 * 30 * 3 * 64 * 4,
)
TRUE = PerfCoefficients(1 / 120e9, 1 / 15e9, 0.003, 0.0004, basis="synthetic")


def _shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        decodes = rng.randint(0, 32)
        prefill = rng.choice([0, 0, rng.randint(16, 2048)])
        if decodes + prefill == 0:
            decodes = 1
        context = decodes * rng.randint(200, 900) + prefill
        pairs = decodes * 500 + prefill * prefill // 2
        shapes.append(StepShape(decodes + prefill, decodes + (prefill > 0), pairs, context))
    return shapes


def test_fit_recovers_known_coefficients():
    model = PerfModel(COSTS, TRUE)
    samples = [Sample(s, model.step_time(s)) for s in _shapes(400)]
    result = fit(samples, COSTS)
    c = result.coefficients
    for name in ("k_compute", "k_memory", "t_step", "t_row"):
        assert getattr(c, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert 0 < result.compute_bound_steps < 400
    assert result.rmse_s < 1e-9


def test_noisy_profile_predicts_within_noise():
    # With 3% noise per step the constant part of the weight reads and t_step trade off against
    # each other, but the fitted model predicts unseen steps and totals as well as the noise allows.
    model = PerfModel(COSTS, TRUE)
    rng = random.Random(1)
    samples = [Sample(s, model.step_time(s) * (1 + rng.gauss(0, 0.03))) for s in _shapes(400)]
    result = fit(samples, COSTS)
    assert result.coefficients.k_compute == pytest.approx(TRUE.k_compute, rel=0.05)
    assert result.mean_abs_error_pct < 4 and abs(result.total_error_pct) < 1
    fitted = PerfModel(COSTS, result.coefficients)
    unseen = _shapes(300, seed=7)
    predicted = sum(fitted.step_time(s) for s in unseen)
    assert predicted == pytest.approx(sum(model.step_time(s) for s in unseen), rel=0.01)


def test_profile_file_cycle_times_include_the_serving_gap(tmp_path):
    lines = []
    for step in range(10):
        lines.append(
            {
                "step": step,
                "time": 0.0,
                "wall_s": 0.05,
                "batch_size": 2,
                "num_batched_tokens": 2,
                "prefill_tokens": 0,
                "decode_requests": 2,
                "context_tokens": 100,
                "num_preempted": 0,
                "num_waiting": 0,
                "attention_pairs": 100,
                "sampled_requests": 2,
                "gap_s": 0.0 if step in (0, 5) else 0.01,
            }
        )
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    samples = load_samples(path)
    # The gap recorded on step i+1 belongs to step i's cycle; step 4 was followed by idleness.
    assert [round(s.seconds, 3) for s in samples] == [0.06] * 4 + [0.05] + [0.06] * 4 + [0.05]
    assert samples[0].shape == StepShape(2, 2, 100, 100)


def test_bad_profiles_name_the_problem(tmp_path):
    with pytest.raises(BadInputFile, match="cannot read"):
        load_samples(tmp_path / "missing.jsonl")
    good = '{"step": 0, "wall_s": 0.1, "num_batched_tokens": 1, "sampled_requests": 1, '
    good += '"attention_pairs": 1, "context_tokens": 1}'
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\nnot json\n")
    with pytest.raises(BadInputFile, match="bad.jsonl:2: not JSON"):
        load_samples(bad)
    old = tmp_path / "old.jsonl"
    old.write_text('{"step": 0, "wall_s": 0.1, "num_batched_tokens": 1}\n')
    with pytest.raises(BadInputFile, match="old.jsonl:1: the step lacks"):
        load_samples(old)
    nan = tmp_path / "nan.jsonl"
    nan.write_text(good + "\n" + good.replace("0.1", "NaN") + "\n")
    with pytest.raises(BadInputFile, match="nan.jsonl:2: wall_s is NaN"):
        load_samples(nan)
    with pytest.raises(CalibrationError, match="too few"):
        fit([Sample(StepShape(1, 1, 1, 1), 0.1)], COSTS)


def test_calibrate_command_writes_a_calibration(tmp_path):
    from typer.testing import CliRunner

    from capacity.calibrate import Calibration
    from capacity.model_specs import load_model_spec
    from capacity.perf import model_costs
    from nightshift.cli import app

    costs = model_costs(load_model_spec("SmolLM2-135M-Instruct"), "fp32")
    model = PerfModel(costs, TRUE)
    lines = []
    for i, s in enumerate(_shapes(60)):
        lines.append(
            {
                "step": i,
                "wall_s": model.step_time(s),
                "num_batched_tokens": s.num_batched_tokens,
                "sampled_requests": s.sampled_rows,
                "attention_pairs": s.attention_pairs,
                "context_tokens": s.context_tokens,
            }
        )
    profile = tmp_path / "steps.jsonl"
    profile.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "calibrate",
            str(profile),
            "--model",
            "SmolLM2-135M-Instruct",
            "--machine",
            "H100",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    saved = Calibration.from_json(json.loads(out.read_text()))
    assert saved.machine == "H100" and saved.steps == 60
    assert saved.coefficients.k_memory == pytest.approx(TRUE.k_memory, rel=1e-6)
    bad = CliRunner().invoke(
        app,
        ["capacity", "calibrate", str(tmp_path / "nope.jsonl"), "--model", "SmolLM2-135M-Instruct"],
    )
    assert bad.exit_code == 2 and "cannot read" in bad.output


def test_calibrate_command_with_no_compute_bound_step(tmp_path):
    # Small decode steps only: the fit fixes k_compute at 0, which has no GFLOP/s to print.
    from typer.testing import CliRunner

    from nightshift.cli import app

    lines = [
        {
            "step": i,
            "wall_s": 0.01 + 0.0001 * i,
            "num_batched_tokens": 2,
            "sampled_requests": 2,
            "attention_pairs": 100,
            "context_tokens": 100 + i,
        }
        for i in range(20)
    ]
    profile = tmp_path / "steps.jsonl"
    profile.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = ["capacity", "calibrate", str(profile), "--model", "SmolLM2-135M-Instruct"]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "cal.json")])
    assert result.exit_code == 0, result.output
    assert "(0 compute-bound)" in result.output and "- GFLOP/s effective" in result.output
