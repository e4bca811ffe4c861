"""Public traces in our format: `nightshift workload import`.

- azure: the Azure LLM inference trace CSV, `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock
  timestamps with 100 ns digits (`2023-11-16 18:15:46.6805900`) -> ms from the earliest.
- mooncake: JSONL with `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token
  blocks), already our format: kept as they are.
- lengths: a CSV of token lengths only, such as Vidur's `num_prefill_tokens,num_decode_tokens`:
  no times, so every request arrives at 0 (a batch).

Azure and length-only traces say nothing about shared prefixes: each request gets fresh block ids
(no reuse). Records come out ordered by timestamp (stable)."""

from __future__ import annotations

import calendar
import csv
import math
from datetime import datetime
from pathlib import Path

from workload.trace import BLOCK_TOKENS, TraceError, TraceRecord, read_trace

FORMATS = ("azure", "mooncake", "lengths")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
INPUT_COLUMNS = ("num_prefill_tokens", "input_length", "input_tokens", "prompt_tokens")
OUTPUT_COLUMNS = ("num_decode_tokens", "output_length", "output_tokens", "completion_tokens")
MOONCAKE_BLOCK_TOKENS = 512


def detect_format(path: Path) -> str:
    """azure, mooncake or lengths, from the first non-empty line."""
    first = _first_line(path)
    if first.lstrip().startswith("{"):
        return "mooncake"
    header = [name.strip() for name in next(csv.reader([first]))]
    if all(name in header for name in AZURE_COLUMNS):
        return "azure"
    if _column(header, INPUT_COLUMNS) is not None and _column(header, OUTPUT_COLUMNS) is not None:
        return "lengths"
    raise TraceError(
        f"{path}:1: cannot tell the format from the header {first[:80]!r}; "
        f"pass --format ({', '.join(FORMATS)})"
    )


def import_trace(path: Path, fmt: str = "auto", block_size: int | None = None) -> list[TraceRecord]:
    """The file's requests as trace records; TraceError names the file, line and column."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "mooncake":
        if block_size not in (None, MOONCAKE_BLOCK_TOKENS):
            raise TraceError(f"{path}: Mooncake hash_ids are 512-token blocks; drop --block-size")
        records = _mooncake(path)
    elif fmt == "azure":
        records = _azure(path, block_size or BLOCK_TOKENS)
    elif fmt == "lengths":
        records = _lengths(path, block_size or BLOCK_TOKENS)
    else:
        raise TraceError(f"unknown format {fmt!r}; use auto, {', '.join(FORMATS)}")
    if not records:
        raise TraceError(f"{path}: no requests in the file")
    records.sort(key=lambda r: r.timestamp)
    return records


def _first_line(path: Path) -> str:
    try:
        with open(path, newline="") as f:
            for line in f:
                if line.strip():
                    return line.strip()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file") from None
    raise TraceError(f"{path}: the file is empty")


def _column(header: list[str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in header), None)


def _rows(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """The header and (line number, row) pairs of a CSV file."""
    try:
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = [name.strip() for name in next(reader, [])]
            rows = []
            for fields in reader:
                if not any(field.strip() for field in fields):
                    continue
                where = f"{path}:{reader.line_num}"
                if len(fields) != len(header):
                    raise TraceError(
                        f"{where}: expected {len(header)} columns ({','.join(header)}), "
                        f"found {len(fields)}"
                    )
                rows.append((reader.line_num, dict(zip(header, fields))))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"{path}: not a readable CSV file ({exc})") from None
    return header, rows


def _count(row: dict[str, str], column: str, where: str) -> int:
    text = row[column].strip()
    if not text.isdigit():
        raise TraceError(f"{where}: column {column!r}: expected a token count, found {text!r}")
    return int(text)


def _nanoseconds(text: str, where: str) -> int:
    """`2023-11-16 18:15:46.6805900` as integer ns (of a naive clock; only differences count)."""
    main, _, fraction = text.strip().partition(".")
    try:
        whole = datetime.strptime(main, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        whole = None
    if whole is None or not (fraction.isdigit() or fraction == "") or len(fraction) > 9:
        raise TraceError(
            f"{where}: column 'TIMESTAMP': expected YYYY-MM-DD HH:MM:SS.fffffff, found {text!r}"
        )
    return calendar.timegm(whole.timetuple()) * 10**9 + int(fraction.ljust(9, "0"))


def _fresh_blocks(start: int, length: int, block_size: int) -> list[int]:
    return list(range(start, start + math.ceil(length / block_size)))


def _azure(path: Path, block_size: int) -> list[TraceRecord]:
    header, rows = _rows(path)
    missing = [name for name in AZURE_COLUMNS if name not in header]
    if missing:
        raise TraceError(f"{path}:1: not an Azure trace: no column {missing[0]!r}")
    parsed = []
    for line, row in rows:
        where = f"{path}:{line}"
        parsed.append(
            (
                _nanoseconds(row["TIMESTAMP"], where),
                _count(row, "ContextTokens", where),
                _count(row, "GeneratedTokens", where),
            )
        )
    origin = min((ns for ns, _, _ in parsed), default=0)
    records, next_id = [], 0
    for ns, context, generated in parsed:
        blocks = _fresh_blocks(next_id, context, block_size)
        next_id += len(blocks)
        records.append(TraceRecord((ns - origin) / 1e6, context, generated, blocks, source="azure"))
    return records


def _lengths(path: Path, block_size: int) -> list[TraceRecord]:
    header, rows = _rows(path)
    inputs, outputs = _column(header, INPUT_COLUMNS), _column(header, OUTPUT_COLUMNS)
    if inputs is None or outputs is None:
        raise TraceError(
            f"{path}:1: a lengths CSV needs an input column ({', '.join(INPUT_COLUMNS)}) "
            f"and an output column ({', '.join(OUTPUT_COLUMNS)})"
        )
    records, next_id = [], 0
    for line, row in rows:
        where = f"{path}:{line}"
        prompt, output = _count(row, inputs, where), _count(row, outputs, where)
        blocks = _fresh_blocks(next_id, prompt, block_size)
        next_id += len(blocks)
        records.append(TraceRecord(0.0, prompt, output, blocks, source="lengths"))
    return records


def _mooncake(path: Path) -> list[TraceRecord]:
    records = read_trace(path)
    for record in records:
        record.source = record.source or "mooncake"
    return records
