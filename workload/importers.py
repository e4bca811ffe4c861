"""Public traces in our format: `nightshift workload import`.

- azure: the Azure LLM inference trace CSV, `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock
  timestamps with 100 ns digits (`2023-11-16 18:15:46.6805900`) -> ms from the earliest.
- mooncake: JSONL with `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token
  blocks), already our format: kept as they are, with their block size written out (a record
  without `block_size` has Mooncake's 512; a trace of ours carries its own).
- lengths: a CSV of token lengths only, such as Vidur's `num_prefill_tokens,num_decode_tokens`:
  no times, so every request arrives at 0 (a batch).

Azure and length-only traces say nothing about shared prefixes: each request gets fresh block ids
(no reuse) of `block_size` tokens (default 512), which every record carries. Records come out
ordered by timestamp (stable)."""

from __future__ import annotations

import calendar
import csv
import math
from datetime import datetime
from pathlib import Path

from workload.input_file import BadInputFile, text_lines
from workload.trace import (
    BLOCK_TOKENS,
    MAX_TOKENS,
    TraceRecord,
    block_size_option_problem,
    read_trace,
)

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
    try:
        header = [name.strip() for name in next(csv.reader([first]))]
    except csv.Error:  # a field past csv's limit (128 KiB): no header of a format we read
        header = []
    if all(name in header for name in AZURE_COLUMNS):
        return "azure"
    if _column(header, INPUT_COLUMNS) is not None and _column(header, OUTPUT_COLUMNS) is not None:
        return "lengths"
    raise BadInputFile(
        path,
        f"cannot tell the format from the header {first[:80]!r}; pass --format "
        f"({', '.join(FORMATS)})",
        1,
    )


def import_trace(path: Path, fmt: str = "auto", block_size: int | None = None) -> list[TraceRecord]:
    """The file's requests as trace records; BadInputFile names the file, line and column, a
    ValueError an unknown format or a block size out of bounds."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if problem := block_size_option_problem(block_size):
        raise ValueError(problem)
    if fmt == "mooncake":
        records = _mooncake(path, block_size)
    elif fmt == "azure":
        records = _azure(path, block_size or BLOCK_TOKENS)
    elif fmt == "lengths":
        records = _lengths(path, block_size or BLOCK_TOKENS)
    else:
        raise ValueError(f"unknown format {fmt!r}; use auto, {', '.join(FORMATS)}")
    if not records:
        raise BadInputFile(path, "no requests in the file")
    records.sort(key=lambda r: r.timestamp)
    return records


def _first_line(path: Path) -> str:
    for _, line in text_lines(path):
        if line.strip():
            return line.strip()
    raise BadInputFile(path, "the file is empty")


def _column(header: list[str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in header), None)


def _rows(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """The header and (line number, row) pairs of a CSV file."""
    reader = csv.reader(line for _, line in text_lines(path))
    try:
        header = [name.strip() for name in next(reader, [])]
        if not any(header):
            raise BadInputFile(path, "the file is empty or its first line is blank")
        rows = []
        for fields in reader:
            if not any(field.strip() for field in fields):
                continue
            if len(fields) != len(header):
                raise BadInputFile(
                    path,
                    f"expected {len(header)} columns ({','.join(header)}), found {len(fields)}",
                    reader.line_num,
                )
            rows.append((reader.line_num, dict(zip(header, fields))))
    except csv.Error as exc:
        raise BadInputFile(path, f"not a readable CSV file ({exc})", reader.line_num) from None
    return header, rows


def _count(row: dict[str, str], column: str, path: Path, line: int, low: int = 0) -> int:
    """A token count from low to MAX_TOKENS (trace.py's bound), in ASCII digits only, no spaces or
    signs (as docs/WORKLOAD.md says): str.isdigit() also takes digits such as '²' that int()
    refuses, and a length of 10^20 would be 10^20 / block size fresh block ids."""
    text = row[column]
    digits = text.isascii() and text.isdigit() and len(text) <= 20
    if not digits or not low <= int(text) <= MAX_TOKENS:
        raise BadInputFile(
            path,
            f"column {column!r}: expected a token count, found {text[:40]!r} "
            f"(a whole number from {low} to {MAX_TOKENS})",
            line,
        )
    return int(text)


def _nanoseconds(text: str, path: Path, line: int) -> int:
    """`2023-11-16 18:15:46.6805900` as integer ns (of a naive clock; only differences count)."""
    main, _, fraction = text.strip().partition(".")
    try:
        whole = datetime.strptime(main, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        whole = None
    digits = fraction == "" or (fraction.isascii() and fraction.isdigit() and len(fraction) <= 9)
    if whole is None or not digits:
        raise BadInputFile(
            path,
            f"column 'TIMESTAMP': expected YYYY-MM-DD HH:MM:SS.fffffff, found {text[:40]!r}",
            line,
        )
    return calendar.timegm(whole.timetuple()) * 10**9 + int(fraction.ljust(9, "0"))


def _fresh_blocks(start: int, length: int, block_size: int) -> list[int]:
    return list(range(start, start + math.ceil(length / block_size)))


def _azure(path: Path, block_size: int) -> list[TraceRecord]:
    header, rows = _rows(path)
    missing = [name for name in AZURE_COLUMNS if name not in header]
    if missing:
        raise BadInputFile(path, f"not an Azure trace: no column {missing[0]!r}", 1)
    parsed = []
    for line, row in rows:
        parsed.append(
            (
                _nanoseconds(row["TIMESTAMP"], path, line),
                _count(row, "ContextTokens", path, line, low=1),
                _count(row, "GeneratedTokens", path, line),
            )
        )
    origin = min((ns for ns, _, _ in parsed), default=0)
    records, next_id = [], 0
    for ns, context, generated in parsed:
        blocks = _fresh_blocks(next_id, context, block_size)
        next_id += len(blocks)
        records.append(
            TraceRecord(
                (ns - origin) / 1e6,
                context,
                generated,
                blocks,
                source="azure",
                block_size=block_size,
            )
        )
    return records


def _lengths(path: Path, block_size: int) -> list[TraceRecord]:
    header, rows = _rows(path)
    inputs, outputs = _column(header, INPUT_COLUMNS), _column(header, OUTPUT_COLUMNS)
    if inputs is None or outputs is None:
        raise BadInputFile(
            path,
            f"a lengths CSV needs an input column ({', '.join(INPUT_COLUMNS)}) "
            f"and an output column ({', '.join(OUTPUT_COLUMNS)})",
            1,
        )
    records, next_id = [], 0
    for line, row in rows:
        prompt = _count(row, inputs, path, line, low=1)
        output = _count(row, outputs, path, line)
        blocks = _fresh_blocks(next_id, prompt, block_size)
        next_id += len(blocks)
        records.append(
            TraceRecord(0.0, prompt, output, blocks, source="lengths", block_size=block_size)
        )
    return records


def _mooncake(path: Path, block_size: int | None) -> list[TraceRecord]:
    """The records as they are, each with its block size written out. --block-size must agree
    with the trace's: another value would change which tokens its hash_ids share, which the file
    says (Mooncake's are 512-token blocks)."""
    records = read_trace(path)
    for record in records:
        record.source = record.source or "mooncake"
        record.block_size = record.hash_block_size
    own = records[0].block_size if records else None
    if block_size is not None and own is not None and block_size != own:
        what = "Mooncake hash_ids are" if own == MOONCAKE_BLOCK_TOKENS else "its hash_ids are"
        raise BadInputFile(
            path, f"{what} {own}-token blocks (block_size); drop --block-size {block_size}"
        )
    return records
