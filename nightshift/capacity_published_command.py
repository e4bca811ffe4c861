"""`nightshift capacity validate --published`: the planner's predictions next to published GPU
serving results, each case's error, and the mean absolute error of the training and the held-out
cases apart (`capacity/published.py`)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import typer

from nightshift.cli_errors import fail, user_errors

MAX_ERROR_PCT = 20.0  # the bound for any case


def _build(case, table):
    """build_run in a worker process; a case the planner refuses comes back as its message."""
    from capacity.gpus import GpuCatalogError
    from capacity.memory import MemoryPlanError
    from capacity.model_specs import ModelSpecError
    from capacity.published import build_run

    try:
        return build_run(case, table)
    except (GpuCatalogError, ModelSpecError, MemoryPlanError) as exc:
        return str(exc)


def validate_published(
    cases_path: Path | None,
    fit_out: Path | None,
    table_path: Path | None,
    out: Path,
    jobs: int | None = None,
    only: tuple[str, ...] = (),
) -> None:
    from capacity.efficiency import DEFAULTS, is_parameter, load_table, save_table
    from capacity.published import (
        PUBLISHED_PATH,
        build_run,
        error_pct,
        fit_table,
        load_cases,
        timed_schedule,
    )
    from nightshift.capacity_commands import _outputs

    _outputs({"-o": out, **({"--fit": fit_out} if fit_out else {})})
    if fit_out is not None and fit_out.resolve() == out.resolve():
        raise fail(f"--fit {fit_out} is also -o: the validation would replace the fitted table")
    if unknown := [n for n in only if not is_parameter(n)]:
        raise fail(f"--fit-only: no such parameter: {', '.join(unknown)}")
    path = cases_path or PUBLISHED_PATH
    with user_errors():
        cases, skipped = load_cases(path)
        table = load_table(table_path)
    if not cases:
        raise fail(f"{path}: no cases")
    runs = []
    # Each case's simulation is independent (and the bundled ones take minutes): one process per
    # core.
    workers = max(1, min(jobs or os.cpu_count() or 1, len(cases)))
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        built = (pool.map if pool else map)(_build, cases, [table] * len(cases))
        for case, run in zip(cases, built):
            # A case the planner cannot run (an unknown GPU, a tp that does not split the model,
            # a pool too small): which one, among dozens.
            if isinstance(run, str):
                raise fail(f"{path}: case {case.id!r}: {run}")
            runs.append(run)
    if fit_out is not None:
        if all(run.case.held_out for run in runs):
            raise fail(
                f"--fit: all {len(runs)} cases of {path} are held out (by a hash of their id); "
                "nothing to fit on"
            )
        # A refit may start from an earlier fit (--table; fitted on the same training cases,
        # so nothing held out leaks in): Nelder-Mead then begins near its minimum.
        try:
            table = fit_table(runs, table if table_path else DEFAULTS, only=only).table
        except ValueError as exc:
            raise fail(f"--fit-only: {exc}" if only else str(exc)) from None
        save_table(table, fit_out)
        runs = [build_run(run.case, table) if timed_schedule(run.case) else run for run in runs]
    rows = []
    for run in runs:
        case = run.case
        rows.append(
            {
                "id": case.id,
                "split": "held out" if case.held_out else "train",
                "source": case.source,
                "gpu": case.gpu,
                "tp": case.tp,
                "model": case.model,
                "dtype": case.dtype,
                "lengths": f"{case.input_len}/{case.output_len}",
                "mode": case.mode if case.mode != "concurrency" else f"c={case.concurrency}",
                "metric": case.metric,
                "published": case.value,
                "predicted": case.value * (1 + error_pct(run, table) / 100),
                "error_pct": error_pct(run, table),
            }
        )
    summary = _summary(rows)
    _print(rows, summary, table.basis)
    for s in skipped:
        typer.echo(f"not simulated: {s.id}: {s.reason}")
    result = {
        "table": table.to_json(),
        "cases": rows,
        "summary": summary,
        "not_simulated": [{"id": s.id, "reason": s.reason} for s in skipped],
        "cases_file": str(path),
    }
    try:
        out.write_text(json.dumps(result, indent=1) + "\n")
    except OSError as exc:
        raise fail(f"cannot write {out}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {out}" + (f" and {fit_out}" if fit_out else ""))


def _summary(rows: list[dict]) -> dict:
    def mae(split: str | None) -> dict:
        errors = [abs(r["error_pct"]) for r in rows if split is None or r["split"] == split]
        return {
            "cases": len(errors),
            "mae_pct": sum(errors) / len(errors) if errors else None,
            "max_abs_error_pct": max(errors, default=None),
        }

    return {"train": mae("train"), "held_out": mae("held out"), "all": mae(None)}


def _print(rows: list[dict], summary: dict, basis: str) -> None:
    typer.echo(f"efficiency table: {basis}")
    header = (
        f"{'case':<44} {'split':<8} {'metric':<20} {'published':>10} {'predicted':>10} {'error':>7}"
    )
    typer.echo(header)
    for r in rows:
        flag = "  !" if abs(r["error_pct"]) > MAX_ERROR_PCT else ""
        typer.echo(
            f"{r['id'][:44]:<44} {r['split']:<8} {r['metric']:<20} {r['published']:>10.4g} "
            f"{r['predicted']:>10.4g} {r['error_pct']:>+6.1f}%{flag}"
        )
    for split in ("train", "held_out", "all"):
        s = summary[split]
        if s["cases"]:
            typer.echo(
                f"{split.replace('_', ' ')}: {s['cases']} cases, MAE {s['mae_pct']:.1f}%, "
                f"largest {s['max_abs_error_pct']:.1f}%"
            )
