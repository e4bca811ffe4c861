"""Defects an outside tester found in `capacity report`, `capacity validate --published` and the
case files they read: each bad input is one line `error: ...` and exit code 2, never a
traceback, an option silently ignored, or a file written over."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from workload.trace import TraceRecord, write_trace

REPORT = ["capacity", "report", "--model", "Llama-3.1-8B", "--gpus", "H100"]


def _report(tmp_path, *args: str):
    trace = tmp_path / "t.jsonl"
    if not trace.exists():
        write_trace(trace, [TraceRecord(0, 300, 40, [1]), TraceRecord(0, 200, 60, [2])])
    out = tmp_path / "r.html"
    return CliRunner().invoke(app, [*REPORT, "--trace", str(trace), "-o", str(out), *args])


def _refused(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: "), result.output
    for word in words:
        assert word in line, line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--deadline", ""], ["--deadline"]),  # was: no deadline, exit 0
        (["--seed", "-1"], ["--seed"]),  # was: accepted
        (["--gpus", ""], ["--gpus"]),  # was: exit 1 and nothing on stderr
        (["--gpus", ",,,"], ["--gpus"]),
        (["--rate", "3"], ["--rate", "poisson"]),  # was: ignored in batch mode
        (["--concurrency", "4"], ["--concurrency"]),
        (["--spec-proposal-rate", "0.5"], ["--spec-proposal-rate", "--speculative-tokens"]),
        (["--spec-proposal-rate", "nan"], ["--spec-proposal-rate"]),
        # was: accepted (and 10^20 hung: the acceptance bisection sums k powers)
        (
            ["--speculative-tokens", "100000", "--spec-acceptance", "0.5"],
            ["--speculative-tokens", "--max-num-batched-tokens"],
        ),
        (["--max-model-len", "10"], ["--max-model-len", "longest"]),  # was: exit 1, as "fits"
        (["--max-model-len", "99999999"], ["--max-model-len", "max_position_embeddings"]),
    ],
)
def test_report_option_refused(tmp_path, args, words):
    _refused(_report(tmp_path, *args), *words)
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("name", ["r.md", "r-kv.png", "r.html"])
def test_report_json_must_not_replace_the_report(tmp_path, name):
    """--json r.md with -o r.html wrote the JSON over the Markdown report."""
    _refused(_report(tmp_path, "--json", str(tmp_path / name)), "--json")
    assert not (tmp_path / "r.md").exists()


def test_report_overflowing_calibration_is_refused(tmp_path):
    """A calibration with k_memory 1e300 gave an infinite makespan, 'Infinity' in the JSON (not
    JSON) and a plan that 'met' the deadline, with numpy warnings on stderr."""
    cal = tmp_path / "cal.json"
    coefficients = {"k_compute": 1e-15, "k_memory": 1e300, "t_step": 0.003, "t_row": 1e-5}
    cal.write_text(
        json.dumps(
            {
                "coefficients": {**coefficients, "basis": "calibrated"},
                "steps": 100,
                "rmse_s": 0.001,
                "mean_abs_error_pct": 3,
                "total_error_pct": 1,
                "compute_bound_steps": 3,
                "machine": "H100",
            }
        )
    )
    result = _report(tmp_path, "--calibration", str(cal), "--json", str(tmp_path / "r.json"))
    _refused(result, "overflow", str(cal))
    assert not (tmp_path / "r.json").exists()


def test_report_without_any_tpot_renders(tmp_path):
    """Requests of one output token have no TPOT: the report's template raised UndefinedError
    (a traceback, and the .md lost) instead of writing n/a."""
    trace = tmp_path / "one.jsonl"
    write_trace(trace, [TraceRecord(0, 100, 1, [])])
    result = CliRunner().invoke(
        app, [*REPORT, "--trace", str(trace), "-o", str(tmp_path / "r.html")]
    )
    assert result.exit_code == 0, result.output
    row = next(line for line in (tmp_path / "r.md").read_text().splitlines() if "| 0 |" in line)
    assert "n/a" in row


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--published", "--train", "t.jsonl"], ["--train", "--published"]),
        (["--cases", "c.jsonl", "--train", "a", "--test", "b"], ["--cases", "--published"]),
        (["--fit", "f.json", "--train", "a", "--test", "b"], ["--fit", "--published"]),
    ],
)
def test_validate_options_of_the_other_kind_refused(tmp_path, args, words):
    result = CliRunner().invoke(
        app, ["capacity", "validate", *args, "-o", str(tmp_path / "v.json")]
    )
    _refused(result, *words)
