"""The trace format: one JSON object a line, the Mooncake / `vllm bench serve` timed-trace
convention plus optional fields of ours.

    {"timestamp": 0, "input_length": 812, "output_length": 143, "hash_ids": [0, 1, 7],
     "kind": "summary", "cached_tokens": 512, "model": "SmolLM2-135M-Instruct", "source": "digest"}

`timestamp` is milliseconds from the trace's start; `hash_ids` name the prompt's fixed-size token
blocks (`block_size` tokens each, the last one partial): equal ids at equal positions mean a shared
prefix. `block_size` is optional; absent, the blocks are BLOCK_TOKENS = 512 tokens (Mooncake's
convention, so their traces read as they are). A trace has one block size: ids of blocks of
different sizes cannot name the same prefix, so read_trace refuses a record whose block size
differs from the first record's (naming its line), and write_trace never writes one. A command's
`--block-size` overrides the trace's (read_trace's `block_size`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from workload.input_file import BadInputFile, Fields, parse_json, text_lines

BLOCK_TOKENS = 512  # Mooncake's block size for hash_ids: a record's block size when it has none

# Bounds of a record's numbers (docs/WORKLOAD.md, "Trace format"). Beyond them a value is a
# corrupt record, not a workload: no model has a context of ten million tokens, and 2**53 ms
# (285,000 years) is where float milliseconds stop being exact.
MAX_TOKENS = 10_000_000
MAX_TIMESTAMP_MS = 2**53
HASH_ID_RANGE = (-(2**63), 2**63 - 1)  # 64-bit ids, as Mooncake's and ours are
# Hash blocks in use are 16 tokens (vLLM's KV block) to 512 (Mooncake); replay draws a whole block
# of tokens per hash_id, so the size is bounded: 65,536 is past every block size in use and keeps
# one block's tokens (8 bytes each as drawn) under a megabyte.
MAX_BLOCK_SIZE = 1 << 16


class UnwritableRecord(ValueError):
    """A record that read_trace would refuse: a bug upstream, never written."""


RecordCheck = Callable[["TraceRecord"], str | None]  # a problem with a record, or None


@dataclass(slots=True)
class TraceRecord:
    timestamp: float  # ms from the trace start
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)
    kind: str | None = None  # summary | review | ...
    cached_tokens: int | None = None
    model: str | None = None
    source: str | None = None
    block_size: int | None = None  # tokens per hash_ids block; None: BLOCK_TOKENS (Mooncake's)

    @property
    def hash_block_size(self) -> int:
        """Tokens per hash_ids block: the record's own, else Mooncake's 512."""
        return BLOCK_TOKENS if self.block_size is None else self.block_size

    def to_json(self) -> dict:
        data = {
            "timestamp": self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        for key in ("block_size", "kind", "cached_tokens", "model", "source"):
            if (value := getattr(self, key)) is not None:
                data[key] = value
        return data


def parse_record(fields: Fields) -> TraceRecord:
    """A record from its JSON object, every field checked (the bounds above)."""
    return TraceRecord(
        timestamp=fields.number("timestamp", 0, MAX_TIMESTAMP_MS),
        input_length=fields.integer("input_length", 1, MAX_TOKENS),
        output_length=fields.integer("output_length", 0, MAX_TOKENS),
        hash_ids=fields.integers("hash_ids", *HASH_ID_RANGE),
        kind=fields.text("kind", None),
        cached_tokens=fields.integer("cached_tokens", 0, MAX_TOKENS, None),
        model=fields.text("model", None),
        source=fields.text("source", None),
        block_size=fields.integer("block_size", 1, MAX_BLOCK_SIZE, None),
    )


def block_size_problem(r: TraceRecord, block_size: int | None = None) -> str | None:
    """A record with more hash_ids than ceil(input_length / block size) (its own, or the given
    one) was written with a smaller block size: read at this one it would share far more than it
    says."""
    size = r.hash_block_size if block_size is None else block_size
    if len(r.hash_ids) > math.ceil(r.input_length / size):
        return (
            f"{len(r.hash_ids)} hash_ids for {r.input_length} tokens do not fit "
            f"{size}-token blocks; pass the trace's --block-size"
        )
    return None


def block_size_option_problem(value: int | None, option: str = "--block-size") -> str | None:
    """Why a command's block-size option is out of the format's bounds, or None."""
    if value is not None and not 1 <= value <= MAX_BLOCK_SIZE:
        return f"{option} must be from 1 to {MAX_BLOCK_SIZE:,}, not {value}"
    return None


def mixed_block_size(block_size: int, first: int, first_line: int) -> str:
    return (
        f"block_size {block_size} differs from the trace's {first} (line {first_line}); a trace "
        f"has one block size (a record without one has {BLOCK_TOKENS})"
    )


def read_trace(
    path: Path, check: RecordCheck | None = None, block_size: int | None = None
) -> list[TraceRecord]:
    """Records in file order. A bad line raises BadInputFile naming the file and the line, as does
    a record whose block size differs from the first record's, and a record for which `check` (a
    command's own rule, such as a context length) names a problem. `block_size` (a command's
    --block-size) replaces every record's before the checks."""
    if problem := block_size_option_problem(block_size):
        raise ValueError(problem)
    records: list[TraceRecord] = []
    first_line = 0
    for number, line in text_lines(path):
        if not line.strip():
            continue
        data = parse_json(line.rstrip("\r\n"), path, number)
        record = parse_record(Fields.of(data, path, number))
        if block_size is not None:
            record.block_size = block_size
        if not records:
            first_line = number
        elif record.hash_block_size != records[0].hash_block_size:
            problem = mixed_block_size(
                record.hash_block_size, records[0].hash_block_size, first_line
            )
            raise BadInputFile(path, problem, number)
        if check is not None and (problem := check(record)):
            raise BadInputFile(path, problem, number)
        records.append(record)
    return records


def checked_json(record: TraceRecord, number: int) -> str:
    """A record's line, after the checks read_trace applies: whatever a command writes, its own
    reader takes back (UnwritableRecord names the record and the problem otherwise)."""
    data = record.to_json()
    try:
        parse_record(Fields.of(data, "<output>", number))
        return json.dumps(data, allow_nan=False)
    except (BadInputFile, ValueError) as exc:
        problem = exc.problem if isinstance(exc, BadInputFile) else str(exc)
        raise UnwritableRecord(f"record {number} would not be a valid trace: {problem}") from None


def write_trace(path: Path, records: Iterable[TraceRecord]) -> int:
    """Write records as JSONL (atomically); returns how many. A record read_trace would refuse
    (NaN, a timestamp past 2^53 ms, ...) is a bug upstream: UnwritableRecord, nothing written.
    A record whose block size differs from the first one's is refused the same way.
    The folder must exist: a mistyped path is an error, not a new folder tree."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    first: int | None = None
    try:
        with tmp.open("w") as f:
            for record in records:
                line = checked_json(record, count + 1)
                first = record.hash_block_size if first is None else first
                if record.hash_block_size != first:
                    problem = mixed_block_size(record.hash_block_size, first, 1)
                    raise UnwritableRecord(
                        f"record {count + 1} would not be a valid trace: {problem}"
                    )
                f.write(line + "\n")
                count += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return count
