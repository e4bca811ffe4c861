"""`nightshift workload export|import|stats|synth`: make, convert, describe and scale traces.

Errors a user can fix (a bad URL, an unreadable or malformed file, a bad option) end in one line
`error: ...` on stderr and exit code 2."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nightshift.cli_errors import fail, user_errors
from nightshift.workload_commands import workload_app

if TYPE_CHECKING:
    from workload.trace import RecordCheck

OutOpt = Annotated[Path, typer.Option("--output", "-o", help="The trace to write (JSONL).")]
BlockOpt = Annotated[
    int,
    typer.Option(help="Tokens per hash_ids block, written into each record (Mooncake's is 512)."),
]


def _since(value: str | None) -> date | None:
    if value is None:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise fail(f"--since must be YYYY-MM-DD, not {value!r}") from None


def _runs(value: str | None) -> set[int] | None:
    if value is None:
        return None
    try:
        return {int(part) for part in value.split(",") if part.strip()}
    except ValueError:
        raise fail(f"--runs must be run ids separated by commas, not {value!r}") from None


def _outputs(files: dict[str, Path | None], folders: dict[str, Path | None] | None = None) -> None:
    """Output paths (option -> path) checked before any work: their folders must exist."""
    from workload.output_file import BadOutputPath, check_file, check_folder

    with user_errors(BadOutputPath):
        for option, path in files.items():
            if path is not None:
                check_file(path, option)
        for option, path in (folders or {}).items():
            if path is not None:
                check_folder(path, option)


def _write(path: Path, records: list) -> int:
    from workload.trace import UnwritableRecord, write_trace

    try:
        return write_trace(path, records)
    except OSError as exc:
        raise fail(f"cannot write {path}: {exc.strerror or exc}") from None
    except UnwritableRecord as exc:
        raise fail(f"nothing written to {path}: {exc}") from None


def _block_size(value: int | None) -> None:
    from workload.trace import block_size_option_problem

    if problem := block_size_option_problem(value):
        raise fail(problem)


def _read(path: Path, check: RecordCheck | None = None, block_size: int | None = None) -> list:
    from workload.trace import read_trace

    with user_errors():
        records = read_trace(path, check, block_size)
    if not records:
        raise fail(f"{path}: the trace has no requests")
    return records


@workload_app.command("export")
def export(
    output: OutOpt,
    db: Annotated[
        str | None,
        typer.Option("--db", help="Database URL. Default: $NIGHTSHIFT_DATABASE_URL or SQLite."),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Only calls started on or after this UTC date, YYYY-MM-DD.")
    ] = None,
    runs: Annotated[str | None, typer.Option(help="Only these run ids, e.g. 3,4.")] = None,
    block_size: BlockOpt = 512,
) -> None:
    """The digest's successful model calls as a trace, with reconstructed prefix sharing."""
    from digest.store.database import default_database_url
    from workload.export import ExportError, export_trace, load_calls

    _outputs({"-o": output})
    day, run_ids = _since(since), _runs(runs)
    _block_size(block_size)
    try:
        calls = load_calls(db or default_database_url(), day, run_ids)
    except ExportError as exc:
        raise fail(str(exc)) from None
    if not calls:
        raise fail("no successful model calls to export (check --db, --since and --runs)")
    count = _write(output, export_trace(calls, block_size))
    typer.echo(f"{count} calls -> {output}", err=True)
    typer.echo(output)


@workload_app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(help="A public trace: Azure CSV, Mooncake JSONL, ...")],
    output: OutOpt,
    fmt: Annotated[
        str, typer.Option("--format", help="auto, azure, mooncake or lengths.")
    ] = "auto",
    block_size: Annotated[
        int | None,
        typer.Option(
            help="Tokens per block for fresh hash_ids (default 512); a JSONL trace keeps its own."
        ),
    ] = None,
) -> None:
    """Convert a public trace into ours."""
    from workload.importers import FORMATS, import_trace

    _outputs({"-o": output})
    if fmt not in ("auto", *FORMATS):
        raise fail(f"unknown format {fmt!r}; use auto, {', '.join(FORMATS)}")
    _block_size(block_size)
    with user_errors():
        records = import_trace(file, fmt, block_size)
    count = _write(output, records)
    typer.echo(f"{count} requests -> {output}", err=True)
    typer.echo(output)


@workload_app.command("stats")
def stats(
    trace: Annotated[Path, typer.Argument(help="A trace (JSONL).")],
    plots: Annotated[
        Path | None, typer.Option(help="Write length histogram and CDF PNGs here.")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the numbers here.")] = None,
) -> None:
    """Count, rate, length percentiles (overall and per kind), prefix reuse, log-normal fits."""
    from workload.stats import format_table, trace_stats

    _outputs({"--json": json_out}, {"--plots": plots})
    records = _read(trace)
    numbers = trace_stats(records)
    typer.echo(format_table(numbers))
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(numbers.to_json(), indent=2) + "\n")
        except OSError as exc:
            raise fail(f"cannot write {json_out}: {exc.strerror or exc}") from None
    if plots is not None:
        from workload.plots import plot_lengths

        try:
            paths = plot_lengths(records, plots, title=trace.stem)
        except OSError as exc:
            raise fail(f"cannot write plots into {plots}: {exc.strerror or exc}") from None
        for path in paths:
            typer.echo(f"plot: {path}", err=True)


@workload_app.command("synth")
def synth(
    like: Annotated[Path, typer.Option("--like", help="The recorded trace to imitate.")],
    papers: Annotated[int, typer.Option(help="Papers (or requests, without kinds) to draw.")],
    output: OutOpt,
    seed: Annotated[int, typer.Option(help="Random seed; same seed, same trace.")] = 0,
    rate: Annotated[
        float | None, typer.Option(help="Papers per second (Poisson); default: all at 0.")
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(help="The source's block size, overriding its records' (default: theirs)."),
    ] = None,
) -> None:
    """A trace of N papers drawn from a recorded one ("what if the column doubles")."""
    from workload.synth import SynthError, block_size_problem, synth_trace

    _outputs({"-o": output})
    _block_size(block_size)
    source = _read(like, block_size_problem, block_size)
    try:
        records, note = synth_trace(source, papers, seed, rate, block_size)
    except SynthError as exc:
        raise fail(str(exc)) from None
    count = _write(output, records)
    typer.echo(f"{note}: {count} requests -> {output}", err=True)
    typer.echo(output)
