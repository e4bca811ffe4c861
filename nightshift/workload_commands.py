"""`nightshift workload ...`: the commands live in `workload_trace_commands.py` (export, import,
stats, synth) and `workload_replay_command.py` (replay); both attach to `workload_app`."""

from __future__ import annotations

import typer

workload_app = typer.Typer(no_args_is_help=True, help="Traces of the digest's load; replay them.")

# The command modules register themselves on workload_app when imported (each adds its line).
from nightshift import workload_replay_command, workload_trace_commands  # noqa: E402, F401
