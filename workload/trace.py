"""The trace format: one JSON object a line, the Mooncake / `vllm bench serve` timed-trace
convention plus optional fields of ours.

    {"timestamp": 0, "input_length": 812, "output_length": 143, "hash_ids": [0, 1, 7],
     "kind": "summary", "cached_tokens": 512, "model": "SmolLM2-135M-Instruct", "source": "digest"}

`timestamp` is milliseconds from the trace's start; `hash_ids` name the prompt's fixed-size token
blocks (BLOCK_TOKENS each, the last one partial): equal ids at equal positions mean a shared
prefix."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from workload.input_file import BadInputFile, Fields, parse_json, text_lines

BLOCK_TOKENS = 512  # Mooncake's block size for hash_ids

# Bounds of a record's numbers (docs/WORKLOAD.md, "Trace format"). Beyond them a value is a
# corrupt record, not a workload: no model has a context of ten million tokens, and 2**53 ms
# (285,000 years) is where float milliseconds stop being exact.
MAX_TOKENS = 10_000_000
MAX_TIMESTAMP_MS = 2**53
HASH_ID_RANGE = (-(2**63), 2**63 - 1)  # 64-bit ids, as Mooncake's and ours are


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

    def to_json(self) -> dict:
        data = {
            "timestamp": self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        for key in ("kind", "cached_tokens", "model", "source"):
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
    )


def read_trace(path: Path, check: RecordCheck | None = None) -> list[TraceRecord]:
    """Records in file order. A bad line raises BadInputFile naming the file and the line, as does
    a record for which `check` (a command's own rule, such as a context length) names a problem."""
    records = []
    for number, line in text_lines(path):
        if not line.strip():
            continue
        data = parse_json(line.rstrip("\r\n"), path, number)
        record = parse_record(Fields.of(data, path, number))
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
    The folder must exist: a mistyped path is an error, not a new folder tree."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    try:
        with tmp.open("w") as f:
            for record in records:
                f.write(checked_json(record, count + 1) + "\n")
                count += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return count
