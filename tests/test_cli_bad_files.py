"""Every command of `nightshift workload` and `nightshift capacity` that reads a file, fed a table
of bad files (binary, empty, truncated, deeply nested, huge numbers, NaN, wrong types, a
directory, a missing file): each ends in one line `error: ...` that names the file (and the line,
for a bad record) and exit code 2, never a traceback, before any network call or server start."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nightshift.cli import app

DEAD_URL = "http://127.0.0.1:9/v1"  # the discard port: nothing listens, nothing may be sent
MODEL = "SmolLM2-135M-Instruct"  # catalogue model: 8192-token context, no weights needed

GOOD = {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [0]}
GOOD_LINE = json.dumps(GOOD)
DEEP = "[" * 100_000


def _record(**changes: object) -> str:
    """A trace line: GOOD with fields replaced (None removes one); values are raw JSON text."""
    return _json_line(GOOD, changes)


def _json_line(base: dict, changes: dict) -> str:
    """base as one JSON object, fields replaced by raw JSON text (None removes one)."""
    fields = {k: json.dumps(v) for k, v in base.items()}
    for key, value in changes.items():
        if value is None:
            fields.pop(key)
        else:
            fields[key] = str(value)
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"


# Files any reader must refuse: (name, bytes). None: a directory; "missing": no file at all.
GENERIC: dict[str, bytes | str | None] = {
    "binary": bytes(range(256)) * 8,
    "empty": b"",
    "blank": b"\n \n\t\n",
    "utf16": '{"timestamp": 0}\n'.encode("utf-16"),
    "deep_list": DEEP.encode(),
    # A first line past csv's 128 KiB field limit that is not JSON: format detection reads it.
    "long_first_line": b"[" * 200_000,
    "deep_object": ('{"a": ' * 100_000).encode(),
    "directory": None,
    "missing": "missing",
}

# Bad records of a JSONL trace, always on line 2 after a good one.
TRACE_RECORDS: dict[str, str] = {
    "truncated": '{"timestamp": 0, "input_len',
    "nan_timestamp": _record(timestamp="NaN"),
    "inf_timestamp": _record(timestamp="Infinity"),
    "neg_inf_timestamp": _record(timestamp="-Infinity"),
    "overflow_timestamp": _record(timestamp="1e400"),
    "negative_timestamp": _record(timestamp=-5),
    "string_timestamp": _record(timestamp='"yesterday"'),
    "nan_input": _record(input_length="NaN"),
    "float_1e20_input": _record(input_length="1e20"),
    "int_1e20_input": _record(input_length=10**20),
    "int_1e400_input": _record(input_length=10**400),
    "int_5000_digits_input": _record(input_length="9" * 5000),
    "negative_input": _record(input_length=-1),
    "zero_input": _record(input_length=0),
    "negative_output": _record(output_length=-1),
    "int_1e20_output": _record(output_length=10**20),
    "string_input": _record(input_length='"100"'),
    "bool_input": _record(input_length="true"),
    "null_input": _record(input_length="null"),
    "missing_output": _record(output_length=None),
    "hash_ids_object": _record(hash_ids='{"0": 1}'),
    "hash_ids_strings": _record(hash_ids='["a"]'),
    "hash_ids_nan": _record(hash_ids="[NaN]"),
    "hash_ids_huge": _record(hash_ids=f"[{10**30}]"),
    "hash_ids_deep": _record(hash_ids="[" * 50_000),
    "kind_list": _record(kind="[1]"),
    "model_object": _record(model="{}"),
    "cached_nan": _record(cached_tokens="NaN"),
    "cached_bool": _record(cached_tokens="true"),
    "record_list": "[1, 2, 3]",
    "duplicate_key": GOOD_LINE[:-1] + ', "input_length": 5}',
    "record_string": '"a request"',
}

# Azure / lengths CSVs (import): bad rows on line 3 after a good one.
AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
LENGTHS_HEAD = "num_prefill_tokens,num_decode_tokens\n3772,54\n"
CSV_FILES: dict[str, tuple[str, str]] = {  # name -> (--format, text)
    "azure_truncated": ("azure", AZURE_HEAD + "2023-11-16 18:15:4"),
    "azure_huge_context": ("azure", AZURE_HEAD + f"2023-11-16 18:15:47.0,{10**20},44\n"),
    "azure_nan_context": ("azure", AZURE_HEAD + "2023-11-16 18:15:47.0,nan,44\n"),
    "azure_superscript": ("azure", AZURE_HEAD + "2023-11-16 18:15:47.0,\u00b2,44\n"),
    "azure_negative": ("azure", AZURE_HEAD + "2023-11-16 18:15:47.0,-3,44\n"),
    "azure_bad_time": ("azure", AZURE_HEAD + "2023-13-45 99:15:47.0,3,44\n"),
    "azure_nul": ("azure", AZURE_HEAD + "2023-11-16 18:15:47.0,3\x00,44\n"),
    "lengths_huge": ("lengths", LENGTHS_HEAD + f"{10**20},54\n"),
    "lengths_zero": ("lengths", LENGTHS_HEAD + "0,54\n"),
    "lengths_float": ("lengths", LENGTHS_HEAD + "1e3,54\n"),
    "lengths_header_only": ("lengths", "num_prefill_tokens,num_decode_tokens\n"),
    "lengths_spaces": ("lengths", LENGTHS_HEAD + " 5 ,54\n"),
    "lengths_huge_field": ("lengths", LENGTHS_HEAD + "1" * 200_000 + ",3\n"),
}

PROFILE_GOOD = {
    "step": 0,
    "wall_s": 0.01,
    "num_batched_tokens": 16,
    "sampled_requests": 1,
    "attention_pairs": 136,
    "context_tokens": 16,
    "gap_s": 0.0,
}


def _step(**changes: object) -> str:
    return _json_line(PROFILE_GOOD, changes)


# Step profiles (calibrate): the bad step on line 2.
PROFILE_RECORDS: dict[str, str] = {
    "truncated": '{"step": 1, "wall_s": 0.0',
    "nan_wall": _step(wall_s="NaN"),
    "inf_gap": _step(gap_s="Infinity"),
    "negative_wall": _step(wall_s=-1),
    "string_tokens": _step(num_batched_tokens='"16"'),
    "huge_tokens": _step(num_batched_tokens=10**400),
    "missing_context": _step(context_tokens=None),
    "missing_step": _step(step=None),
    "record_list": "[]",
}

# GPU files (report --gpu-file), by suffix.
GPU_FILES: dict[str, tuple[str, str]] = {
    "json_nan": (
        ".json",
        '{"X1": {"memory_gib": NaN, "bandwidth_gbps": 1, "bf16_tflops": 1, "price_per_hour": 1}}',
    ),
    "json_overflow": (".json", '{"L4": {"memory_gib": 1e400}}'),
    "json_list_of_strings": (".json", '["L4"]'),
    "yaml_nan": (".yaml", "L4:\n  bandwidth_gbps: .nan\n"),
    "yaml_inf": (".yaml", "L4:\n  memory_gib: .inf\n"),
    "yaml_string": (".yaml", "L4:\n  memory_gib: lots\n"),
    "yaml_deep": (".yaml", DEEP),
    "yaml_truncated": (".yaml", "L4:\n  memory_gib: [1,"),
}

# Calibrations (report --calibration).
CALIBRATION_FILES: dict[str, str] = {
    "list": "[]",
    "missing_keys": '{"steps": 3}',
    "nan_coefficient": json.dumps(
        {
            "coefficients": {
                "k_compute": "NaN",
                "k_memory": 1e-9,
                "t_step": 0.001,
                "t_row": 0.0,
                "basis": "x",
            },
            "steps": 9,
            "rmse_s": 0.0,
            "mean_abs_error_pct": 0.0,
            "total_error_pct": 0.0,
            "compute_bound_steps": 0,
            "machine": "L4",
        }
    ).replace('"NaN"', "NaN"),
    "coefficients_list": json.dumps(
        {
            "coefficients": [1, 2],
            "steps": 9,
            "rmse_s": 0.0,
            "mean_abs_error_pct": 0.0,
            "total_error_pct": 0.0,
            "compute_bound_steps": 0,
            "machine": "L4",
        }
    ),
    "truncated": '{"coefficients": {"k_comp',
}

_CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
}
# Model config.json files (report --model FOLDER).
CONFIG_FILES: dict[str, str] = {
    "list": "[1]",
    "missing_fields": '{"hidden_size": 64}',
    "zero_heads": json.dumps({**_CONFIG, "num_attention_heads": 0}),
    "negative_layers": json.dumps({**_CONFIG, "num_hidden_layers": -2}),
    "string_positions": json.dumps({**_CONFIG, "max_position_embeddings": "long"}),
    "nan_head_dim": json.dumps(_CONFIG)[:-1] + ', "head_dim": NaN}',
    "overflow_head_dim": json.dumps(_CONFIG)[:-1] + ', "head_dim": 1e400}',
    "text_config_list": json.dumps({**_CONFIG, "text_config": [1]}),
    "truncated": '{"hidden_size": 6',
}


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    argv: tuple[str, ...]  # "{file}", "{out}", "{good}", "{root}" are filled in per test
    content: bytes | str | None  # None: a directory; "missing": nothing at the path
    suffix: str = ".jsonl"
    line: int | None = None  # the line a record error must name
    folder_file: str | None = None  # the content goes into folder/folder_file; {file}: the folder


OUT = ("-o", "{out}")
VALIDATE = ("capacity", "validate", "--workdir", "{root}/work", *OUT)
TRACE_COMMANDS: dict[str, tuple[str, ...]] = {
    "stats": ("workload", "stats", "{file}"),
    "import": ("workload", "import", "{file}", *OUT),
    "import_mooncake": ("workload", "import", "{file}", "--format", "mooncake", *OUT),
    "synth": ("workload", "synth", "--like", "{file}", "--papers", "3", *OUT),
    "replay": ("workload", "replay", "{file}", "--base-url", DEAD_URL, "--model", "m", *OUT),
    "report": ("capacity", "report", "--model", MODEL, "--gpus", "L4", "--trace", "{file}", *OUT),
    "validate_train": (*VALIDATE, "--train", "{file}", "--test", "{good}"),
    "validate_test": (*VALIDATE, "--train", "{good}", "--test", "{file}"),
}
REPORT = ("capacity", "report", "--model", MODEL, "--gpus", "L4", *OUT)
OTHER_COMMANDS: dict[str, tuple[str, ...]] = {
    "import_azure": ("workload", "import", "{file}", "--format", "azure", *OUT),
    "import_lengths": ("workload", "import", "{file}", "--format", "lengths", *OUT),
    "calibrate": ("capacity", "calibrate", "{file}", "--model", MODEL, *OUT),
    "gpu_file": (*REPORT, "--gpu-file", "{file}"),
    "calibration": (*REPORT, "--calibration", "{file}"),
    "export_db": ("workload", "export", "--db", "sqlite:///{file}", *OUT),
}


def _cases() -> list[Case]:
    cases = []
    for command, argv in {**TRACE_COMMANDS, **OTHER_COMMANDS}.items():
        for name, content in GENERIC.items():
            cases.append(Case(f"{command}-{name}", argv, content))
    for command, argv in TRACE_COMMANDS.items():
        for name, line in TRACE_RECORDS.items():
            cases.append(Case(f"{command}-{name}", argv, f"{GOOD_LINE}\n{line}\n", line=2))
    for name, (fmt, text) in CSV_FILES.items():
        lines = text.count("\n") + (not text.endswith("\n"))
        line = lines if "header_only" not in name else None
        cases.append(
            Case(f"import_{fmt}-{name}", OTHER_COMMANDS[f"import_{fmt}"], text, ".csv", line)
        )
    for name, line in PROFILE_RECORDS.items():
        text = f"{_step()}\n{line}\n"
        cases.append(Case(f"calibrate-{name}", OTHER_COMMANDS["calibrate"], text, line=2))
    cases.append(Case("calibrate-too_few_steps", OTHER_COMMANDS["calibrate"], _step() + "\n"))
    for name, (suffix, text) in GPU_FILES.items():
        cases.append(Case(f"gpu_file-{name}", OTHER_COMMANDS["gpu_file"], text, suffix))
    for name, text in CALIBRATION_FILES.items():
        cases.append(Case(f"calibration-{name}", OTHER_COMMANDS["calibration"], text, ".json"))
    model_argv = ("capacity", "report", "--model", "{file}", "--gpus", "L4", *OUT)
    for name, text in {**CONFIG_FILES, "binary": GENERIC["binary"], "deep": DEEP}.items():
        cases.append(Case(f"model_config-{name}", model_argv, text, folder_file="config.json"))
    # A tokenizer folder (replay --tokenizer) whose tokenizer.json is binary or malformed.
    replay = ("workload", "replay", "{good}", "--base-url", DEAD_URL, "--model", "m", *OUT)
    for name, text in {"binary": GENERIC["binary"], "wrong_fields": '{"model": 5}'}.items():
        argv = (*replay, "--tokenizer", "{file}")
        cases.append(Case(f"replay_tokenizer-{name}", argv, text, folder_file="tokenizer.json"))
    # Longer than the model's context (report: SmolLM2's 8192; validate: --max-model-len 2048).
    too_long = f"{GOOD_LINE}\n{_record(input_length=9000)}\n"
    cases.append(Case("report-longer_than_context", TRACE_COMMANDS["report"], too_long, line=2))
    for command in ("validate_train", "validate_test"):
        cases.append(
            Case(f"{command}-longer_than_context", TRACE_COMMANDS[command], too_long, line=2)
        )
    # More hash_ids than 512-token blocks of the input: written with a smaller block size.
    blocks = f"{GOOD_LINE}\n{_record(hash_ids=[1, 2, 3])}\n"
    cases.append(Case("replay-too_many_hash_ids", TRACE_COMMANDS["replay"], blocks, line=2))
    return cases


CASES = _cases()


def materialize(case: Case, root: Path) -> tuple[list[str], str]:
    """Write the case's file under root; the command line and the bad file's path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "out").mkdir(exist_ok=True)  # an output's folder must exist; it stays empty
    good = root / "good.jsonl"
    good.write_text(f"{GOOD_LINE}\n" * 3)
    path = root / f"bad{case.suffix}"
    if case.folder_file is not None:
        folder = root / "model"
        folder.mkdir()
        target = folder / case.folder_file
        path = folder
    else:
        target = path
    if case.content is None:
        target.mkdir()
    elif case.content != "missing":
        data = case.content.encode() if isinstance(case.content, str) else case.content
        target.write_bytes(data)
    values = {
        "file": str(path),
        "out": str(root / "out" / "result"),
        "good": str(good),
        "root": str(root),
    }
    return [part.format(**values) if "{" in part else part for part in case.argv], str(path)


def check_output(case: Case, path: str, code: int, output: str) -> None:
    assert "Traceback" not in output, output
    assert code == 2, f"exit {code}: {output}"
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert path in errors[0], errors[0]
    if case.line is not None:
        assert f"{path}:{case.line}:" in errors[0], errors[0]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_file_is_one_line_and_exit_2(case: Case, tmp_path: Path, runner: CliRunner) -> None:
    argv, path = materialize(case, tmp_path)
    result = runner.invoke(app, argv)
    # An exception that escaped the command is a traceback for a user, whatever it printed.
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}"
    )
    check_output(case, path, result.exit_code, result.output)
    assert not any((tmp_path / "out").iterdir()), "nothing is written for a bad input"


def _limited() -> None:
    # 2 GiB of address space: a command that sizes memory by a number in the file dies of it.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nightshift.cli", *argv]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, preexec_fn=_limited, env=env
    )


SUBPROCESS_CASES = [
    "stats-binary",
    "import-deep_list",
    "import_mooncake-nan_timestamp",
    "replay-int_1e20_input",
    "import_azure-azure_huge_context",
    "report-longer_than_context",
]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_file_in_a_real_process(case_id: str, tmp_path: Path) -> None:
    case = next(c for c in CASES if c.id == case_id)
    argv, path = materialize(case, tmp_path)
    done = _run(argv)
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stdout == ""
    check_output(case, path, done.returncode, done.stderr)


def test_replay_of_a_giant_input_length_fails_fast_without_allocating(tmp_path: Path) -> None:
    """input_length 10^20 (and 10^7, within the format's bound but past the replay cap) must be
    refused before a prompt is built: in a process limited to 2 GiB, within seconds."""
    for length in (10**20, 10**7):
        trace = tmp_path / f"giant-{length}.jsonl"
        trace.write_text(f"{GOOD_LINE}\n{_record(input_length=length)}\n")
        argv = ["workload", "replay", str(trace), "--base-url", DEAD_URL, "--model", "m"]
        done = _run([*argv, "-o", str(tmp_path / "r.json")])
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert f"{trace}:2: input_length" in done.stderr, done.stderr
        assert not (tmp_path / "r.json").exists()


def test_import_never_writes_nan(tmp_path: Path, runner: CliRunner) -> None:
    trace = tmp_path / "nan.jsonl"
    trace.write_text(f"{GOOD_LINE}\n{_record(timestamp='NaN')}\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["workload", "import", str(trace), "-o", str(out)])
    assert result.exit_code == 2 and f"{trace}:2: timestamp" in result.output
    assert not out.exists()


SAMPLE = str(Path(__file__).resolve().parent.parent / "capacity" / "data" / "digest_sample.jsonl")
SYNTH = ("workload", "synth", "--like", SAMPLE, "--papers", "2", "-o", "{out}")
REPLAY = ("workload", "replay", SAMPLE, "--base-url", DEAD_URL, "--model", "m", "-o", "{out}")
# Bad options: (command line, a word the error line must hold). Refused before any work.
BAD_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "synth_negative_seed": ((*SYNTH, "--seed", "-1"), "--seed"),
    "synth_huge_papers": ((*SYNTH[:4], "--papers", "99999999999", *SYNTH[6:]), "--papers"),
    "synth_tiny_rate": ((*SYNTH, "--rate", "1e-300"), "--rate"),
    "synth_subnormal_rate": ((*SYNTH, "--rate", "1e-320"), "--rate"),
    "synth_nan_rate": ((*SYNTH, "--rate", "nan"), "--rate"),
    "replay_negative_seed": ((*REPLAY, "--seed", "-1"), "--seed"),
    "replay_nan_burstiness": (
        (*REPLAY, "--mode", "poisson", "--rate", "1", "--burstiness", "nan"),
        "--burstiness",
    ),
    "replay_inf_time_scale": ((*REPLAY, "--time-scale", "inf"), "--time-scale"),
    "replay_nan_duration": ((*REPLAY, "--max-duration", "nan"), "--max-duration"),
    "replay_nan_timeout": ((*REPLAY, "--request-timeout", "nan"), "--request-timeout"),
    "replay_zero_max_requests": ((*REPLAY, "--max-requests", "0"), "--max-requests"),
    "report_negative_seed": ((*REPORT, "--papers", "2", "--seed", "-1"), "--seed"),
    "report_huge_papers": ((*REPORT, "--papers", "99999999999"), "--papers"),
    "report_unknown_dtype": ((*REPORT, "--dtype", "fp2"), "--dtype"),
    "report_utilization_2": ((*REPORT, "--utilization", "2"), "--utilization"),
    "report_utilization_negative": ((*REPORT, "--utilization", "-1"), "--utilization"),
    "report_utilization_nan": ((*REPORT, "--utilization", "nan"), "--utilization"),
    "report_zero_seqs": ((*REPORT, "--max-num-seqs", "0"), "--max-num-seqs"),
    "report_zero_tokens": ((*REPORT, "--max-num-batched-tokens", "0"), "--max-num-batched-tokens"),
    "report_nan_price": ((*REPORT, "--api-price-per-mtok", "nan,inf"), "--api-price-per-mtok"),
    "report_negative_price": ((*REPORT, "--api-price-per-mtok", "-1,1"), "--api-price-per-mtok"),
    "calibrate_unknown_dtype": (
        ("capacity", "calibrate", SAMPLE, "--model", MODEL, "--dtype", "fp2", "-o", "{out}"),
        "--dtype",
    ),
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_option_is_one_line_and_exit_2(name: str, tmp_path: Path, runner: CliRunner) -> None:
    argv, word = BAD_OPTIONS[name]
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "result"
    result = runner.invoke(app, [part.replace("{out}", str(out)) for part in argv])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and word in errors[0], result.output
    assert not any((tmp_path / "out").iterdir()), "nothing is written for a bad option"


# Every output path of every command: (command line with {path}, the option, a file option?).
OUTPUTS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "export": (("workload", "export", "--db", "sqlite:///{root}/n.db", "-o", "{path}"), "-o", True),
    "import": (("workload", "import", SAMPLE, "-o", "{path}"), "-o", True),
    "synth": ((*SYNTH[:-1], "{path}"), "-o", True),
    "stats_json": (("workload", "stats", SAMPLE, "--json", "{path}"), "--json", True),
    "stats_plots": (("workload", "stats", SAMPLE, "--plots", "{path}"), "--plots", False),
    "replay": ((*REPLAY[:-1], "{path}"), "-o", True),
    "replay_plots": ((*REPLAY, "--plots", "{path}"), "--plots", False),
    "calibrate": (("capacity", "calibrate", SAMPLE, "--model", MODEL, "-o", "{path}"), "-o", True),
    "report": ((*REPORT[:-1], "{path}"), "-o", True),
    "validate": (
        ("capacity", "validate", "--train", SAMPLE, "--test", SAMPLE, "-o", "{path}"),
        "-o",
        True,
    ),
    "validate_workdir": (
        ("capacity", "validate", "--train", SAMPLE, "--test", SAMPLE, "--workdir", "{path}"),
        "--workdir",
        False,
    ),
}
OUTPUT_CASES = [
    (name, bad)
    for name, (_, _, is_file) in OUTPUTS.items()
    for bad in ("missing_folder", "a_folder")[: 1 + is_file]
]


@pytest.mark.parametrize(("name", "bad"), OUTPUT_CASES, ids=[f"{n}-{b}" for n, b in OUTPUT_CASES])
def test_bad_output_path_is_refused_first(
    name: str, bad: str, tmp_path: Path, runner: CliRunner
) -> None:
    """An output whose folder does not exist is refused (not created), and a file option that
    names a folder is refused (not written beside it), before anything is read or sent."""
    argv, option, _ = OUTPUTS[name]
    (tmp_path / "out").mkdir()
    out = tmp_path / "nonexistent" / "x.json" if bad == "missing_folder" else tmp_path / "out"
    (tmp_path / "out" / "work").mkdir()  # validate's default --workdir, made relative below
    cwd = os.getcwd()
    os.chdir(tmp_path / "out")
    try:
        root = tmp_path / "out"
        values = {"path": str(out), "root": str(root), "out": str(root / "r.json")}
        result = runner.invoke(app, [part.format(**values) for part in argv])
    finally:
        os.chdir(cwd)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{option} {out}" in errors[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["work"], "nothing is written"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"timestamp": "1e400"}, "timestamp 1e400 is out of range"),
        ({"timestamp": "-1e400"}, "timestamp -1e400 is out of range"),
        ({"input_length": "1e400"}, "input_length 1e400 is out of range"),
        ({"timestamp": "Infinity"}, "timestamp is Infinity"),
    ],
)
def test_a_number_past_float_range_is_out_of_range(
    changes: dict, message: str, tmp_path: Path, runner: CliRunner
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(f"{GOOD_LINE}\n{_record(**changes)}\n")
    result = runner.invoke(app, ["workload", "stats", str(trace)])
    assert result.exit_code == 2 and f"{trace}:2: {message}" in result.output, result.output


def test_a_duplicate_key_is_named(tmp_path: Path, runner: CliRunner) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINE[:-1] + ', "input_length": 5}\n')
    result = runner.invoke(app, ["workload", "stats", str(trace)])
    assert result.exit_code == 2, result.output
    assert f"{trace}:1: " in result.output and "'input_length' appears twice" in result.output
