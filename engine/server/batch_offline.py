"""`nightshift batch run INPUT.jsonl -o OUTPUT.jsonl`: a Batch API input file run on the engine in
this process, no server (as `vllm run-batch`). The file is checked whole first (the same rules as
POST /v1/batches, so a bad line is named before the model loads); every line then goes through
the server's own routes in process, as the server's batch runner sends them, and its result line
(OpenAI's output format, successes and errors in the one file as vLLM writes it) is appended the
moment it ends. A rerun with the same OUTPUT after a kill runs only the lines not in it yet."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import batch_journal
from engine.server.app import create_app
from engine.server.batch_config import BATCH_ENDPOINTS
from engine.server.batch_lines import app_client, run_line, succeeded
from engine.server.batch_validate import BatchLine, parse_input


class BatchFileError(ValueError):
    """The input file (or the output file it would resume) is refused; the message names why."""


@dataclass(frozen=True, slots=True)
class OfflineReport:
    total: int
    already_done: int  # found in OUTPUT from an earlier run
    completed: int  # 2xx this run
    failed: int


def check_input(data: bytes, served_model: str | None, max_lines: int) -> tuple[str, str, list]:
    """(endpoint, served model name, lines). The endpoint is the first line's url; the served
    name, unless given, the first line's body.model (a file written for a cloud model runs as
    it is on ours)."""
    number, first = _first_request(data)
    endpoint = first.get("url", BATCH_ENDPOINTS[0])  # unreadable: parse_input names the line
    if endpoint not in BATCH_ENDPOINTS:
        raise BatchFileError(
            f"the input file is refused: line {number}: url {endpoint!r} is not one of "
            f"{', '.join(BATCH_ENDPOINTS)}"
        )
    body = first.get("body") if isinstance(first.get("body"), dict) else {}
    name = served_model or (body.get("model") if isinstance(body.get("model"), str) else None)
    name = name or "default"
    parsed = parse_input(data, endpoint, name, max_lines)
    if parsed.errors:
        shown = "; ".join(
            f"line {e.line}: {e.message}" if e.line else e.message for e in parsed.errors[:5]
        )
        more = f" (and {len(parsed.errors) - 5} more)" if len(parsed.errors) > 5 else ""
        raise BatchFileError(f"the input file is refused: {shown}{more}")
    return endpoint, name, parsed.lines


def run_batch_file(
    config: EngineConfig,
    input_path: Path,
    output_path: Path,
    served_model: str | None = None,
    concurrency: int | None = None,
    max_lines: int = 1_000_000,
) -> OfflineReport:
    try:
        data = input_path.read_bytes()
    except OSError as e:
        raise BatchFileError(f"cannot read {input_path}: {e.strerror or e}") from None
    endpoint, name, lines = check_input(data, served_model, max_lines)
    done = _resumable(output_path, lines)
    todo = [line for line in lines if line.custom_id not in done]
    engine = AsyncEngine(config) if todo else None
    try:
        counts = [0, 0]
        if engine is not None:
            app = create_app(engine, name)
            slots = concurrency or config.max_num_seqs  # no live traffic to leave room for
            counts = asyncio.run(_run(app, endpoint, todo, output_path, slots))
    finally:
        if engine is not None:
            engine.shutdown()
    return OfflineReport(len(lines), len(done), counts[0], counts[1])


def _first_request(data: bytes) -> tuple[int, dict]:
    """The first non-blank line's number and object ({} when it is not one)."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                return number, {}  # parse_input names the line
            return number, obj if isinstance(obj, dict) else {}
    raise BatchFileError("the input file holds no requests")


def _resumable(output_path: Path, lines: list[BatchLine]) -> set[str]:
    """The custom_ids OUTPUT already holds; refused when it holds another file's results."""
    try:
        done = batch_journal.recover(output_path)
    except OSError as e:
        raise BatchFileError(f"cannot read {output_path}: {e.strerror or e}") from None
    wanted = {line.custom_id for line in lines}
    strangers = [custom_id for custom_id in done if custom_id not in wanted]
    if strangers:
        raise BatchFileError(
            f"{output_path} holds results of another input (custom_id {strangers[0]!r} is not "
            "in this one); give a new output file"
        )
    return set(done)


async def _run(app, endpoint: str, todo: list[BatchLine], output: Path, slots: int) -> list[int]:
    counts = [0, 0]
    gate = asyncio.Semaphore(slots)
    async with app_client(app, None) as client:

        async def one(line: BatchLine) -> None:
            async with gate:
                result = await run_line(client, endpoint, line, priority=0)
            batch_journal.append(output, result)
            counts[0 if succeeded(result) else 1] += 1

        await asyncio.gather(*(one(line) for line in todo))
    batch_journal.sync(output)
    return counts
