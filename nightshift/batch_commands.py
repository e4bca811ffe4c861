"""`nightshift batch run`: a Batch API input file run offline on the engine (engine/server/
batch_offline.py), the same format as the server's /v1/batches and `vllm run-batch`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nightshift.cli_errors import user_errors

batch_app = typer.Typer(no_args_is_help=True, help="OpenAI Batch API files, run offline.")


@batch_app.command("run")
def batch_run(
    input_file: Annotated[Path, typer.Argument(help="Requests, one JSON line each (OpenAI's).")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Results, one JSON line each; resumed if there.")
    ],
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The name the lines' body.model must give (default: the first's)."),
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Lines in the engine at once (default: max-num-seqs).", min=1)
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 64,
    max_model_len: Annotated[int | None, typer.Option()] = None,
    dtype: Annotated[str, typer.Option()] = "auto",
    device: Annotated[str, typer.Option()] = "auto",
) -> None:
    """Run every request of INPUT_FILE and write each result to OUTPUT as it finishes."""
    from engine.config import EngineConfig
    from engine.server.batch_offline import run_batch_file

    # A bad file (line-numbered), a bad model folder or option: one line and exit 2.
    with user_errors(ValueError, OSError):
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        report = run_batch_file(config, input_file, output, served_model_name, concurrency)
    resumed = f", {report.already_done} already in {output}" if report.already_done else ""
    typer.echo(
        f"{report.total} requests: {report.completed} completed, {report.failed} failed"
        f"{resumed} -> {output}"
    )
