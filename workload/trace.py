"""The trace format: one JSON object a line, the Mooncake / `vllm bench serve` timed-trace
convention plus optional fields of ours.

    {"timestamp": 0, "input_length": 812, "output_length": 143, "hash_ids": [0, 1, 7],
     "kind": "summary", "cached_tokens": 512, "model": "SmolLM2-135M-Instruct", "source": "digest"}

`timestamp` is milliseconds from the trace's start; `hash_ids` name the prompt's fixed-size token
blocks (BLOCK_TOKENS each, the last one partial): equal ids at equal positions mean a shared
prefix."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_TOKENS = 512  # Mooncake's block size for hash_ids


class TraceError(ValueError):
    """A trace file or record that is not valid; the message names the file, line and field."""


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


def _record(data: object, where: str) -> TraceRecord:
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in data:
            raise TraceError(f"{where}: missing {key!r}")
    ints = {k: data[k] for k in ("input_length", "output_length")}
    for key, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TraceError(f"{where}: {key!r} must be a non-negative integer, not {value!r}")
    stamp = data["timestamp"]
    if not isinstance(stamp, int | float) or isinstance(stamp, bool) or stamp < 0:
        raise TraceError(f"{where}: 'timestamp' must be non-negative milliseconds, not {stamp!r}")
    hash_ids = data.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    cached = data.get("cached_tokens")
    if cached is not None and (not isinstance(cached, int) or cached < 0):
        raise TraceError(f"{where}: 'cached_tokens' must be a non-negative integer")
    return TraceRecord(
        timestamp=float(stamp),
        input_length=ints["input_length"],
        output_length=ints["output_length"],
        hash_ids=hash_ids,
        kind=data.get("kind"),
        cached_tokens=cached,
        model=data.get("model"),
        source=data.get("source"),
    )


def read_trace(path: Path) -> list[TraceRecord]:
    """Records in file order; a bad line raises TraceError naming it."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        records.append(_record(data, where))
    return records


def write_trace(path: Path, records: Iterable[TraceRecord]) -> int:
    """Write records as JSONL (atomically); returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    with tmp.open("w") as f:
        for record in records:
            f.write(json.dumps(record.to_json()) + "\n")
            count += 1
    tmp.replace(path)
    return count
