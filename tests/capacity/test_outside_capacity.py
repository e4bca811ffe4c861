"""Defects an outside tester found in `capacity report`, `capacity validate --published` and the
case files they read: each bad input is one line `error: ...` and exit code 2, never a
traceback, an option silently ignored, or a file written over."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from tests.capacity.test_published import BASE
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


# test_published's record, smaller: what a user's own case file would hold.
CASE = {**BASE, "id": "outside-small", "input_len": 128, "output_len": 16, "num_requests": 8}


def _validate(tmp_path, *cases: dict, args: tuple[str, ...] = ()):
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    out = ["-o", str(tmp_path / "v.json")]
    return CliRunner().invoke(
        app, ["capacity", "validate", "--published", "--cases", str(path), *out, *args]
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # was: a traceback from the simulation (a record past max_model_len)
        ({"max_model_len": 10}, ["cases.jsonl:1", "max_model_len"]),
        # was: planned at the default 0.9 (`or 0.9`)
        ({"gpu_memory_utilization": 0}, ["cases.jsonl:1", "gpu_memory_utilization"]),
        ({"id": ""}, ["cases.jsonl:1", "id"]),  # was: a case without a name
        # was: a TPOT of 0 ms, error -100%
        ({"metric": "mean_tpot_ms", "output_len": 1}, ["cases.jsonl:1", "output_len"]),
        ({"per_gpu": "no"}, ["cases.jsonl:1", "per_gpu"]),  # was: bool("no"), per GPU
        ({"complete": "false"}, ["cases.jsonl:1", "complete"]),
        ({"tp": 2, "num_gpus": 1}, ["cases.jsonl:1", "num_gpus"]),  # was: simulated at tp 2
        # was: "error: unknown dtype 'fp4'", not naming the case among dozens
        ({"dtype": "fp4"}, ["cases.jsonl", "outside-small", "fp4"]),
        ({"planner_gpu": "B200"}, ["cases.jsonl", "outside-small", "B200"]),
    ],
)
def test_published_case_refused(tmp_path, change, words):
    _refused(_validate(tmp_path, {**CASE, **change}), *words)


def test_fit_with_only_held_out_cases_is_refused(tmp_path):
    """Every case held out: fit_table's ValueError was a traceback."""
    held = next(f"h{i}" for i in range(100) if _held_out(f"h{i}"))
    fit = tmp_path / "fit.json"
    _refused(_validate(tmp_path, {**CASE, "id": held}, args=("--fit", str(fit))), "--fit")
    assert not fit.exists()


def test_fit_and_out_the_same_file_is_refused(tmp_path):
    """-o FILE --fit FILE wrote the fitted table, then the validation over it."""
    same = str(tmp_path / "v.json")
    result = _validate(tmp_path, CASE, args=("--fit", same))
    _refused(result, "--fit", "-o")


def _held_out(case_id: str) -> bool:
    import hashlib

    return hashlib.sha256(case_id.encode()).digest()[0] % 3 == 0
