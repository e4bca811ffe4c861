"""`workload import`: each public format from a small fixture, exact records, and bad rows named
by file, line and column."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from workload.importers import detect_format, import_trace
from workload.trace import TraceRecord, read_trace, write_trace

FIXTURES = Path(__file__).parent / "fixtures"
runner = CliRunner()


def test_azure_timestamps_to_ms_and_fresh_blocks():
    records = import_trace(FIXTURES / "azure_conv.csv")
    assert records == [
        TraceRecord(0.0, 374, 44, [0], source="azure", block_size=512),
        TraceRecord(4314.579, 396, 109, [1], source="azure", block_size=512),
        TraceRecord(4319.41, 1025, 7, [2, 3, 4], source="azure", block_size=512),
        TraceRecord(13442.8667, 512, 2, [5], source="azure", block_size=512),
    ]


def test_azure_rows_out_of_order_are_sorted_from_the_earliest(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47.5,10,1\n"
        "2023-11-16 18:15:46,20,2\n"
    )
    records = import_trace(path, "azure", block_size=16)
    assert [(r.timestamp, r.input_length, r.hash_ids) for r in records] == [
        (0.0, 20, [1, 2]),
        (1500.0, 10, [0]),
    ]


def test_mooncake_kept_as_it_is():
    records = import_trace(FIXTURES / "mooncake.jsonl")
    assert records == [
        TraceRecord(0.0, 1000, 50, [0, 1], source="mooncake", block_size=512),
        TraceRecord(0.0, 1300, 3, [0, 2, 3], source="mooncake", block_size=512),
        TraceRecord(3006.0, 600, 316, [4, 5], source="mooncake", block_size=512),
        TraceRecord(4015.0, 1200, 20, [0, 2, 6], source="mooncake", block_size=512),
    ]


def test_lengths_are_a_batch_with_fresh_blocks():
    records = import_trace(FIXTURES / "vidur_lengths.csv")
    assert records == [
        TraceRecord(0.0, 3772, 54, list(range(0, 8)), source="lengths", block_size=512),
        TraceRecord(0.0, 2015, 156, [8, 9, 10, 11], source="lengths", block_size=512),
        TraceRecord(0.0, 512, 100, [12], source="lengths", block_size=512),
    ]


def test_detect_format():
    assert detect_format(FIXTURES / "azure_conv.csv") == "azure"
    assert detect_format(FIXTURES / "mooncake.jsonl") == "mooncake"
    assert detect_format(FIXTURES / "vidur_lengths.csv") == "lengths"


@pytest.mark.parametrize(
    ("text", "fmt", "message"),
    [
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,1\n"
            "2023-11-16 18:15:47.1,ten,1\n",
            "auto",
            "bad.txt:3: column 'ContextTokens': expected a token count, found 'ten'",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n16/11/2023 18:15,10,1\n",
            "auto",
            "bad.txt:2: column 'TIMESTAMP': expected YYYY-MM-DD HH:MM:SS.fffffff",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10\n",
            "auto",
            "bad.txt:2: expected 3 columns (TIMESTAMP,ContextTokens,GeneratedTokens), found 2",
        ),
        (
            "num_prefill_tokens,num_decode_tokens\n10,1\n5,-3\n",
            "auto",
            "bad.txt:3: column 'num_decode_tokens': expected a token count, found '-3'",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1\n',
            "auto",
            "bad.txt:2: not JSON",
        ),
        ("a,b,c\n1,2,3\n", "auto", "bad.txt:1: cannot tell the format"),
        ("\n\n", "auto", "bad.txt: the file is empty"),
        ("num_prefill_tokens,num_decode_tokens\n", "auto", "bad.txt: no requests"),
        ("a,b\n1,2\n", "azure", "bad.txt:1: not an Azure trace: no column 'TIMESTAMP'"),
        ("a,b\n1,2\n", "lengths", "bad.txt:1: a lengths CSV needs an input column"),
        ("a,b\n1,2\n", "parquet", "unknown format 'parquet'"),
    ],
)
def test_bad_files_name_file_line_and_column(tmp_path, text, fmt, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        import_trace(path, fmt)
    assert message in str(excinfo.value)
    assert str(excinfo.value).startswith(str(path) if "bad.txt" in message else "unknown")


def test_mooncake_refuses_another_block_size():
    with pytest.raises(ValueError, match="Mooncake hash_ids are 512-token blocks"):
        import_trace(FIXTURES / "mooncake.jsonl", block_size=16)
    assert import_trace(FIXTURES / "mooncake.jsonl", block_size=512)[0].block_size == 512


def test_imported_records_carry_their_block_size(tmp_path):
    """Fresh blocks are --block-size tokens, and the written trace says so: a reader of it (the
    planner, replay) then cuts prompts at 16 tokens, not at Mooncake's 512."""
    records = import_trace(FIXTURES / "vidur_lengths.csv", block_size=16)
    assert {r.block_size for r in records} == {16}
    assert [len(r.hash_ids) for r in records] == [236, 126, 32]  # ceil(length / 16)
    out = tmp_path / "t.jsonl"
    run = runner.invoke(
        app,
        ["workload", "import", str(FIXTURES / "azure_conv.csv"), "--block-size", "16", "-o", out],
    )
    assert run.exit_code == 0, run.output
    assert {r.block_size for r in read_trace(out)} == {16}


def test_a_trace_of_ours_keeps_its_block_size(tmp_path):
    ours = tmp_path / "ours.jsonl"
    write_trace(ours, [TraceRecord(0, 40, 1, [0, 1, 2], block_size=16)])
    assert import_trace(ours)[0].block_size == 16
    assert import_trace(ours, block_size=16)[0].block_size == 16
    with pytest.raises(ValueError, match="its hash_ids are 16-token blocks"):
        import_trace(ours, block_size=512)


def test_cli_block_size_bounds(tmp_path):
    for value in ("0", "65537"):
        run = runner.invoke(
            app,
            ["workload", "import", str(FIXTURES / "azure_conv.csv"), "--block-size", value,
             "-o", tmp_path / "t.jsonl"],
        )  # fmt: skip
        assert run.exit_code == 2 and "--block-size must be from 1 to 65,536" in run.output


def test_cli_import_then_errors(tmp_path):
    out = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["workload", "import", str(FIXTURES / "azure_conv.csv"), "-o", out])
    assert result.exit_code == 0, result.output
    assert [r.input_length for r in read_trace(out)] == [374, 396, 1025, 512]
    missing = runner.invoke(app, ["workload", "import", str(tmp_path / "nope.csv"), "-o", out])
    assert missing.exit_code == 2
    assert missing.output.startswith(f"error: {tmp_path / 'nope.csv'}: cannot read")
    fmt = runner.invoke(
        app, ["workload", "import", str(FIXTURES / "vidur_lengths.csv"), "-o", out, "--format", "x"]
    )
    assert fmt.exit_code == 2 and "error: unknown format 'x'" in fmt.output
