"""`nightshift capacity calibrate|report`: fit the performance model to a step profile, and plan
hardware for a workload."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nightshift.cli_errors import fail, user_errors

if TYPE_CHECKING:
    from capacity.model_specs import ModelSpec
    from capacity.planner import PlanSettings
    from workload.trace import RecordCheck, TraceRecord

capacity_app = typer.Typer(no_args_is_help=True, help="Memory, performance and cost planning.")

# The planner's default workload: a real digest night of 300 papers (capacity/data/digest_night.md).
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "capacity" / "data" / "digest_night.jsonl"


def _outputs(files: dict[str, Path], folders: dict[str, Path] | None = None) -> None:
    """Output paths (option -> path) checked before any work: their folders must exist, and a
    file option naming a folder is refused rather than written beside it."""
    from workload.output_file import BadOutputPath, check_file, check_folder

    with user_errors(BadOutputPath):
        for option, path in files.items():
            check_file(path, option)
        for option, path in (folders or {}).items():
            check_folder(path, option)


def _spec(model: str) -> ModelSpec:
    from capacity.model_specs import ModelSpecError, load_model_spec
    from engine.model_fetch import resolve_model

    try:
        return load_model_spec(resolve_model(model) if model == "default" else model)
    except (ModelSpecError, ValueError) as exc:
        raise fail(str(exc)) from None


@capacity_app.command("calibrate")
def calibrate(
    profile: Annotated[Path, typer.Argument(help="Step profile (serve --profile-path).")],
    model: Annotated[str, typer.Option(help="'default', a config.json folder or a name.")] = (
        "default"
    ),
    dtype: Annotated[str, typer.Option(help="The dtype the engine ran in.")] = "fp32",
    machine: Annotated[
        str | None, typer.Option(help="Name of the machine (a GPU name to match the catalogue).")
    ] = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="Calibration JSON.")] = Path(
        "calibration.json"
    ),
) -> None:
    """Fit the performance model's coefficients to a step profile; print the fit error."""
    from capacity.calibrate import CalibrationError, fit, load_samples
    from capacity.perf import model_costs

    _outputs({"-o": out})
    _dtype(dtype)
    spec = _spec(model)
    with user_errors():
        samples = load_samples(profile)
    try:
        result = fit(samples, model_costs(spec, dtype), machine or _machine_name())
    except CalibrationError as exc:
        raise fail(f"{profile}: {exc}") from None
    c = result.coefficients
    if not all(map(math.isfinite, (c.k_compute, c.k_memory, c.t_step, c.t_row, result.rmse_s))):
        raise fail(f"{profile}: the fit gave non-finite coefficients; the steps cannot be fitted")
    _write(out, json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    typer.echo(
        f"{result.steps} steps of {profile} ({result.compute_bound_steps} compute-bound) on "
        f"{result.machine}:\n"
        f"  {_giga(c.k_compute)} GFLOP/s effective, {_giga(c.k_memory)} GB/s "
        f"effective, {c.t_step * 1000:.2f} ms per step, {c.t_row * 1000:.3f} ms per sampled row\n"
        f"  fit: RMSE {result.rmse_s * 1000:.2f} ms per step, mean |error| "
        f"{result.mean_abs_error_pct:.1f}%, total {result.total_error_pct:+.2f}%\n"
        f"wrote {out}"
    )


def _giga(seconds_per_unit: float) -> str:
    # A coefficient the fit fixed at 0 (no step bound by that ceiling) has no rate to show.
    return f"{1 / seconds_per_unit / 1e9:.1f}" if seconds_per_unit > 0 else "-"


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise fail(f"cannot write {path}: {exc.strerror or exc}") from None


def _fits(max_len: int, what: str) -> RecordCheck:
    """A trace record must fit the context it is planned for (its output at least one token, as
    replay and the simulation send it)."""

    def check(record: TraceRecord) -> str | None:
        total = record.input_length + max(1, record.output_length)
        if total <= max_len:
            return None
        return (
            f"input_length {record.input_length} + output_length {record.output_length} = "
            f"{total} tokens, more than {what} of {max_len}"
        )

    return check


def _with_blocks(check: RecordCheck) -> RecordCheck:
    """`check`, and hash_ids that fit the record's block size (the trace's or --block-size): a
    trace written with smaller blocks, read at 512, would share far more than it says."""
    from workload.trace import block_size_problem

    def both(record: TraceRecord) -> str | None:
        return check(record) or block_size_problem(record)

    return both


def _machine_name() -> str:
    import os

    from engine.bench import cpu_name

    return f"{cpu_name()} ({os.cpu_count()} CPUs, {platform.machine()})"


@capacity_app.command("report")
def report(
    model: Annotated[str, typer.Option(help="A catalogue name, a config.json folder, 'default'.")],
    gpus: Annotated[
        str, typer.Option(help="Comma-separated GPU names.")
    ] = "4090,L4,A100-80GB,H100",
    trace: Annotated[Path | None, typer.Option(help="The workload (workload export).")] = None,
    papers: Annotated[
        int | None, typer.Option(help="Draw this many papers from the trace's distribution.")
    ] = None,
    deadline: Annotated[str | None, typer.Option(help="e.g. 2h, 90m, 3600s.")] = None,
    tp: Annotated[str, typer.Option(help="Tensor-parallel sizes, comma-separated.")] = "1",
    dtype: Annotated[str, typer.Option(help="bf16, fp16, fp8, int8, int4.")] = "bf16",
    kv_cache_dtype: Annotated[
        str,
        typer.Option(help="auto (the compute dtype), bf16, fp16, fp32, fp8 or int8 (1 byte)."),
    ] = "auto",
    max_num_seqs: Annotated[int, typer.Option()] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option()] = 8192,
    utilization: Annotated[float, typer.Option(help="gpu_memory_utilization.")] = 0.9,
    api_price_per_mtok: Annotated[
        str | None, typer.Option(help="IN,OUT: a cloud API's USD per million tokens.")
    ] = None,
    gpu_file: Annotated[Path | None, typer.Option(help="YAML/JSON adding GPUs.")] = None,
    calibration: Annotated[Path | None, typer.Option(help="From capacity calibrate.")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="The engine's max_model_len (default: the longest request, rounded up).", min=1
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(
            help="Tokens per hash_ids block of the trace, overriding its records' block_size "
            "(default: theirs, 512 where absent). Not the engine's KV block size (16)."
        ),
    ] = None,
    mode: Annotated[
        str,
        typer.Option(
            help="How requests arrive: batch, trace (its timestamps), poisson, concurrency."
        ),
    ] = "batch",
    rate: Annotated[float | None, typer.Option(help="poisson: requests per second.")] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="concurrency: most requests in flight.")
    ] = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="report.html (and .md)")] = Path(
        "capacity-report.html"
    ),
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also every figure, unrounded, as JSON.")
    ] = None,
    speculative_tokens: Annotated[
        int,
        typer.Option(help="Speculative decoding: draft tokens per step (0: none; the digest: 4)."),
    ] = 0,
    spec_acceptance: Annotated[
        float | None,
        typer.Option(help="With --speculative-tokens: accepted share of drafts (vLLM's rate)."),
    ] = None,
    spec_proposal_rate: Annotated[
        float | None,
        typer.Option(
            help="With --speculative-tokens: share of decode steps that propose (default 1)."
        ),
    ] = None,
    search: Annotated[
        bool,
        typer.Option("--search", help="Also search max_num_seqs x max_num_batched_tokens per GPU."),
    ] = False,
    enforce_eager: Annotated[
        bool,
        typer.Option(
            "--enforce-eager",
            help="vLLM's --enforce-eager: no CUDA graphs (slower steps, no graph memory).",
        ),
    ] = False,
) -> None:
    """Which GPU, how many, how long tonight's batch takes, at what cost."""
    import numpy as np

    from capacity.calibrate import load_calibration
    from capacity.gpus import GpuCatalogError, find_gpu, load_gpus
    from capacity.report import build_report, render, report_json, tp_note
    from workload.synth import SynthError, synth_trace
    from workload.trace import block_size_option_problem, read_trace

    _outputs({"-o": out, **({"--json": json_out} if json_out else {})})
    _json_apart(out, json_out)
    if problem := block_size_option_problem(block_size):
        raise fail(problem)
    if seed < 0:  # the simulation's and synth's generators take only non-negative seeds
        raise fail(f"--seed must be >= 0, not {seed}")
    settings = replace(
        _settings(dtype, max_num_seqs, max_num_batched_tokens, utilization),
        deadline_s=_seconds(deadline) if deadline is not None else None,
        kv_cache_dtype=_kv_cache_dtype(kv_cache_dtype),
        load=_load(mode, rate, concurrency, seed),
        max_model_len=max_model_len,
        speculation=_speculation(speculative_tokens, spec_acceptance, spec_proposal_rate, seed),
        enforce_eager=enforce_eager,
        **_prices(api_price_per_mtok),
    )
    if settings.speculation and settings.speculation.num_tokens >= max_num_batched_tokens:
        raise fail(
            f"--speculative-tokens {speculative_tokens}: a decoding request verifies 1 + "
            f"{speculative_tokens} tokens in one step, more than --max-num-batched-tokens "
            f"{max_num_batched_tokens}"
        )
    tps = _ints(tp, "--tp")
    if not [name for name in gpus.split(",") if name.strip()]:
        raise fail(f"--gpus must name at least one GPU, not {gpus!r}")
    spec = _spec(model)
    fits = _fits(spec.max_position_embeddings, f"{spec.name}'s context")
    path = trace or DEFAULT_TRACE
    with user_errors(GpuCatalogError, SynthError):
        catalogue = load_gpus(gpu_file)
        chosen = [find_gpu(name.strip(), catalogue) for name in gpus.split(",") if name.strip()]
        cal = load_calibration(calibration) if calibration else None
        source = read_trace(path, _with_blocks(fits), block_size)
        note = f"trace {trace}" if trace else f"the bundled digest night ({DEFAULT_TRACE.name})"
        if papers is not None:
            source, how = synth_trace(source, papers, seed=seed)
            note = f"{how}, from {note}"
    if not source:
        raise fail(f"{path}: the workload has no requests")
    # Drawn papers combine recorded lengths: an input and an output that each fit may not together.
    if papers is not None and (problem := next(filter(None, map(fits, source)), None)):
        raise fail(f"a paper drawn from {path}: {problem}; try another --seed")
    _check_max_model_len(max_model_len, source, spec)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing times: _finite_times
        result = build_report(spec, source, note, chosen, tps, settings, cal, search=search)
    _finite_times(result, calibration, gpu_file)
    try:
        written = render(result, out)
    except OSError as exc:
        raise fail(f"cannot write {out}: {exc.strerror or exc}") from None
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report_json(result), indent=1) + "\n")
        except OSError as exc:
            raise fail(f"cannot write {json_out}: {exc.strerror or exc}") from None
        written.append(json_out)
    for name in written:
        typer.echo(f"wrote {name}")
    if all(plan.error for plan in result.plans):
        # The report says why each one fails; a script that asked "what fits?" learns "nothing".
        for plan in result.plans:
            note = tp_note(plan)
            typer.echo(
                f"{plan.gpu.name} tp {plan.tp}: {plan.error}{' ' + note if note else ''}", err=True
            )
        raise typer.Exit(1)


def _json_apart(out: Path, json_out: Path | None) -> None:
    """--json must not be one of the files -o writes (the .html, the .md, the plots): the JSON,
    written last, would replace it."""
    if json_out is None:
        return
    written = [out.with_suffix(".html"), out.with_suffix(".md")]
    written += [out.with_name(f"{out.stem}-{name}.png") for name in ("scaling", "kv")]
    if json_out.resolve() in {path.resolve() for path in written}:
        raise fail(f"--json {json_out} is one of the files -o {out} writes; give another name")


def _check_max_model_len(max_model_len: int | None, trace: list, spec: ModelSpec) -> None:
    """--max-model-len against the workload and the model, before any work: a bad one is the
    option's mistake on every GPU, not something a larger GPU would fix."""
    if max_model_len is None:
        return
    if max_model_len > spec.max_position_embeddings:
        raise fail(
            f"--max-model-len {max_model_len} exceeds {spec.name}'s context "
            f"(max_position_embeddings {spec.max_position_embeddings})"
        )
    longest = max(r.input_length + r.output_length for r in trace)
    if max_model_len < longest:
        raise fail(
            f"--max-model-len {max_model_len} is shorter than the workload's longest request "
            f"({longest} tokens, prompt and output)"
        )


def _finite_times(result, calibration: Path | None, gpu_file: Path | None) -> None:
    """A calibration or GPU file with extreme figures (a k_memory of 1e300) makes step times
    overflow: an infinite makespan would be written as 'Infinity' (not JSON) and as a plan that
    'meets' the deadline. Refused before anything is written."""
    for plan in result.plans:
        if plan.sim is not None and not math.isfinite(plan.sim.makespan_s):
            given = " or ".join(
                f"{option} {path}"
                for option, path in (("--calibration", calibration), ("--gpu-file", gpu_file))
                if path is not None
            )
            raise fail(
                f"{plan.gpu.name} tp {plan.tp}: the simulated makespan is "
                f"{plan.sim.makespan_s}; the step times overflow"
                + (f" (check the coefficients in {given})" if given else "")
            )


def _speculation(tokens: int, acceptance: float | None, proposal_rate: float | None, seed: int):
    from capacity.simulate import Speculation

    if tokens == 0:
        if acceptance is not None:
            raise fail("--spec-acceptance needs --speculative-tokens K (K >= 1)")
        if proposal_rate is not None:
            raise fail("--spec-proposal-rate needs --speculative-tokens K (K >= 1)")
        return None
    if tokens < 0:
        raise fail(f"--speculative-tokens must be >= 0, not {tokens}")
    if acceptance is None:
        raise fail(
            "--speculative-tokens needs --spec-acceptance, the accepted share of drafts "
            "(a recorded run's vllm:spec_decode_num_accepted_tokens / num_draft_tokens)"
        )
    try:
        return Speculation(
            tokens, acceptance, 1.0 if proposal_rate is None else proposal_rate, seed
        )
    except ValueError as exc:
        raise fail(f"--spec-acceptance / --spec-proposal-rate: {exc}") from None


def _load(mode: str, rate: float | None, concurrency: int | None, seed: int):
    from capacity.simulate import Load

    # An option the mode does not read would be silently ignored: the user meant another mode.
    if rate is not None and mode != "poisson":
        raise fail(f"--rate is for --mode poisson, not --mode {mode}")
    if concurrency is not None and mode != "concurrency":
        raise fail(f"--concurrency is for --mode concurrency, not --mode {mode}")
    try:
        return Load(mode, rate, concurrency, seed)
    except ValueError as exc:
        raise fail(str(exc)) from None


def _dtype(dtype: str) -> None:
    from capacity.memory import WEIGHT_FORMATS, MemoryPlanError, normalize_dtype

    try:
        normalize_dtype(dtype, WEIGHT_FORMATS)
    except MemoryPlanError as exc:
        raise fail(f"--dtype: {exc}") from None


def _kv_cache_dtype(text: str) -> str | None:
    """--kv-cache-dtype as the planner takes it: None for auto (the compute dtype)."""
    from capacity.memory import KV_DTYPE_BYTES, MemoryPlanError, normalize_dtype

    if text.strip().lower() == "auto":
        return None
    try:
        return normalize_dtype(text.strip(), KV_DTYPE_BYTES)
    except MemoryPlanError as exc:
        raise fail(f"--kv-cache-dtype: {exc} or auto") from None


def _settings(dtype: str, max_num_seqs: int, max_batched: int, utilization: float) -> PlanSettings:
    """The planner's settings from report's options, each checked: a bad one would otherwise
    show up only as a table cell ("does not fit") or a $nan cost, with exit code 0."""
    from capacity.planner import PlanSettings

    _dtype(dtype)
    if not 0 < utilization <= 1:  # also NaN
        raise fail(f"--utilization must be a fraction in (0, 1], not {utilization:g}")
    for option, value in (
        ("--max-num-seqs", max_num_seqs),
        ("--max-num-batched-tokens", max_batched),
    ):
        if value < 1:
            raise fail(f"{option} must be at least 1, not {value}")
    return PlanSettings(
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        utilization=utilization,
    )


def _seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise fail(f"--deadline must look like 2h, 90m or 3600s, not {text!r}")
    return seconds


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise fail(f"{option} must be comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise fail(f"{option} must name positive integers")
    return values


def _prices(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        price_in, price_out = (float(part) for part in text.split(","))
    except ValueError:
        raise fail(f"--api-price-per-mtok must be IN,OUT (USD), not {text!r}") from None
    if not all(0 <= price < math.inf for price in (price_in, price_out)):  # also NaN
        raise fail(f"--api-price-per-mtok must be two finite prices >= 0, not {text!r}")
    return {"api_price_in": price_in, "api_price_out": price_out}


@capacity_app.command("validate")
def validate(
    train: Annotated[
        Path | None, typer.Option(help="Trace replayed while profiling (calibration).")
    ] = None,
    test: Annotated[
        Path | None, typer.Option(help="A different trace: predicted, then replayed.")
    ] = None,
    published: Annotated[
        bool,
        typer.Option(
            "--published",
            help="Instead: predict published GPU results (--cases) and print each error.",
        ),
    ] = False,
    cases: Annotated[
        Path | None, typer.Option(help="--published: the cases (default: the bundled ones).")
    ] = None,
    fit: Annotated[
        Path | None,
        typer.Option(help="--published: fit the efficiency table on the training cases, here."),
    ] = None,
    table: Annotated[
        Path | None,
        typer.Option(
            help="--published: the efficiency table to check (with --fit: the fit's start, "
            "default the built-in defaults)."
        ),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(help="--published: cases simulated at once (default: one per CPU).", min=1),
    ] = None,
    fit_only: Annotated[
        str | None,
        typer.Option(
            help="--fit: only these parameters (comma-separated, e.g. hopper.link,link), the "
            "others kept at --table's values."
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    num_kv_blocks: Annotated[int, typer.Option()] = 1200,
    max_num_seqs: Annotated[int, typer.Option()] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option()] = 512,
    max_model_len: Annotated[int, typer.Option()] = 2048,
    workdir: Annotated[Path, typer.Option(help="Profiles and replay results.")] = Path(
        "capacity-validation"
    ),
    out: Annotated[Path, typer.Option("-o", "--out")] = Path("capacity-validation.json"),
) -> None:
    """Calibrate on one trace's replay, predict another's, replay it, print the errors; or,
    with --published, predict published GPU results."""
    from capacity.validate import ValidationSettings, run_validation
    from workload.trace import read_trace

    # An option of the other kind of validation would be silently ignored.
    if published and (given := [o for o, v in (("--train", train), ("--test", test)) if v]):
        raise fail(f"--published does not read {' or '.join(given)}")
    if not published and (
        given := [
            o
            for o, v in (
                ("--cases", cases),
                ("--fit", fit),
                ("--table", table),
                ("--jobs", jobs),
                ("--fit-only", fit_only),
            )
            if v
        ]
    ):
        raise fail(f"only --published reads {', '.join(given)}")
    if published:
        from nightshift.capacity_published_command import validate_published

        if fit_only is not None and fit is None:
            raise fail("--fit-only needs --fit")
        only = tuple(n.strip() for n in (fit_only or "").split(",") if n.strip())
        if fit_only is not None and not only:
            raise fail("--fit-only: no parameter names given")
        return validate_published(cases, fit, table, out, jobs, only)
    if train is None or test is None:
        raise fail("validate needs --train and --test traces (or --published)")
    _outputs({"-o": out}, {"--workdir": workdir})
    if min(num_kv_blocks, max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
        raise fail(
            "--num-kv-blocks, --max-num-seqs, --max-num-batched-tokens and --max-model-len "
            "must be at least 1"
        )
    # Checked before a server starts: the simulation refuses a record past max_model_len.
    fits = _fits(max_model_len, "--max-model-len")
    with user_errors():
        train_records, test_records = read_trace(train, fits), read_trace(test, fits)
    for path, records in ((train, train_records), (test, test_records)):
        if not records:
            raise fail(f"{path}: the trace has no requests")
    settings = ValidationSettings(
        model, num_kv_blocks, 16, max_num_seqs, max_num_batched_tokens, max_model_len
    )
    result = run_validation(train_records, test_records, settings, workdir, _machine_name())
    _write(out, json.dumps(result.to_json(), indent=2) + "\n")
    cal = result.calibration
    typer.echo(
        f"calibrated on {train} ({cal.steps} steps, mean step error "
        f"{cal.mean_abs_error_pct:.1f}%), predicted {test}:\n"
        f"  makespan  real {result.real_makespan_s:.1f} s, predicted "
        f"{result.predicted_makespan_s:.1f} s: {result.makespan_error_pct:+.1f}%\n"
        f"  mean E2E  real {result.real_mean_e2e_s:.1f} s, predicted "
        f"{result.predicted_mean_e2e_s:.1f} s: {result.e2e_error_pct:+.1f}%\n"
        f"wrote {out}"
    )
