"""The trace format's block size: a record carries the size of its hash_ids blocks (absent:
Mooncake's 512), a trace has one, and a command's --block-size overrides it."""

from __future__ import annotations

import json

import pytest

from workload.input_file import BadInputFile
from workload.trace import (
    BLOCK_TOKENS,
    MAX_BLOCK_SIZE,
    TraceRecord,
    UnwritableRecord,
    block_size_problem,
    read_trace,
    write_trace,
)


def _lines(path, *records: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _record(**fields) -> dict:
    return {"timestamp": 0, "input_length": 40, "output_length": 1, **fields}


def test_block_size_is_read_written_and_defaults_to_mooncakes(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRecord(0, 40, 1, [0, 1, 2], block_size=16)])
    assert json.loads(path.read_text())["block_size"] == 16
    assert read_trace(path)[0].hash_block_size == 16
    _lines(path, _record(hash_ids=[0]))  # a Mooncake record: no block_size
    (record,) = read_trace(path)
    assert record.block_size is None and record.hash_block_size == BLOCK_TOKENS == 512
    assert "block_size" not in record.to_json()


@pytest.mark.parametrize("value", [0, -16, MAX_BLOCK_SIZE + 1, 16.0, "16", True])
def test_a_block_size_out_of_bounds_names_the_line(tmp_path, value):
    path = tmp_path / "t.jsonl"
    _lines(path, _record(block_size=16), _record(block_size=value))
    with pytest.raises(BadInputFile, match=r"t\.jsonl:2: block_size must be an integer from 1"):
        read_trace(path)
    with pytest.raises(UnwritableRecord, match="block_size"):
        write_trace(tmp_path / "o.jsonl", [TraceRecord(0, 40, 1, block_size=value)])


def test_a_trace_mixing_block_sizes_is_refused_at_the_line(tmp_path):
    """Ids of 16-token and 512-token blocks cannot name the same prefixes: the record whose
    size differs from the first's is named, a record without one counting as 512."""
    path = tmp_path / "mixed.jsonl"
    _lines(path, _record(block_size=16), _record(block_size=16), _record())
    with pytest.raises(BadInputFile) as excinfo:
        read_trace(path)
    assert str(excinfo.value) == (
        f"{path}:3: block_size 512 differs from the trace's 16 (line 1); a trace has one block "
        "size (a record without one has 512)"
    )
    _lines(path, _record(), _record(block_size=512))  # absent is 512: the same size
    assert len(read_trace(path)) == 2
    out = tmp_path / "out.jsonl"
    mixed = [TraceRecord(0, 40, 1, block_size=16), TraceRecord(0, 40, 1)]
    with pytest.raises(UnwritableRecord, match="record 2 .* differs from the trace's 16"):
        write_trace(out, mixed)
    assert not out.exists()


def test_a_command_block_size_overrides_the_traces(tmp_path):
    path = tmp_path / "t.jsonl"
    _lines(path, _record(hash_ids=[0, 1, 2], block_size=16), _record(hash_ids=[0]))
    # Mixed as written, one size once overridden.
    records = read_trace(path, block_size=16)
    assert [r.hash_block_size for r in records] == [16, 16]
    with pytest.raises(ValueError, match="--block-size must be from 1 to 65,536, not 0"):
        read_trace(path, block_size=0)


def test_hash_ids_beyond_the_block_size_are_a_problem():
    record = TraceRecord(0, 40, 1, [0, 1, 2], block_size=16)
    assert block_size_problem(record) is None  # ceil(40 / 16) = 3
    assert "do not fit 512-token blocks" in block_size_problem(record, 512)
    assert "do not fit 512-token blocks" in block_size_problem(TraceRecord(0, 40, 1, [0, 1, 2]))
