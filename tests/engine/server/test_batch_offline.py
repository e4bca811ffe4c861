"""`nightshift batch run INPUT -o OUTPUT`: the Batch API's file format run offline on the engine.
Results equal the offline engine's greedy answers; a bad file is one line naming the line, exit
2, before the model loads; a rerun into the same OUTPUT runs only what is missing."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine import LLM, SamplingParams
from nightshift.cli import app
from tests.engine.server.live_server import build_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("offline-model"))


def _line(custom_id: str, content: str) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _run(model_dir, *args):
    base = ["batch", "run", *args, "--model", str(model_dir), "--max-model-len", "256"]
    return CliRunner().invoke(app, base)


def test_offline_batch_matches_the_engine_and_resumes(model_dir, tmp_path):
    lines = [_line(f"q{i}", f"Question {i}?") for i in range(4)]
    _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = _run(model_dir, str(tmp_path / "in.jsonl"), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "4 requests: 4 completed, 0 failed" in result.output
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(results) == ["q0", "q1", "q2", "q3"]
    llm = LLM(model=str(model_dir), max_model_len=256)
    want = llm.chat(lines[2]["body"]["messages"], SamplingParams(temperature=0, max_tokens=6))[0]
    body = results["q2"]["response"]["body"]
    assert results["q2"]["response"]["status_code"] == 200
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    # A run killed half-way left two lines (one torn): the rerun adds only the other two.
    kept = out.read_text().splitlines(keepends=True)[:2]
    out.write_text("".join(kept) + '{"custom_id": "q')
    again = _run(model_dir, str(tmp_path / "in.jsonl"), "-o", str(out))
    assert again.exit_code == 0, again.output
    assert "2 already in" in again.output
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == ["q0", "q1", "q2", "q3"]
    assert out.read_text().splitlines(keepends=True)[:2] == kept


def test_bad_file_is_one_line_and_exit_2(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    _write(bad, [_line("a", "hi"), _line("a", "again")])
    result = _run(model_dir, str(bad), "-o", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 2
    assert "line 2" in result.output and "custom_id 'a'" in result.output
    bad.write_text('{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}\n{oops\n')
    result = _run(model_dir, str(bad), "-o", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 2 and "line 1" in result.output and "line 2" in result.output
    for content, says in (
        (b"", "no requests"),
        (b"\n\n", "no requests"),
        (b"\x00\xff\xfe binary", "line 1"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"custom_id": "n", "x": ' + b"9" * 5000 + b"}", "line 1"),
        (json.dumps(_line("nan", "hi")).replace(": 0}", ": NaN}").encode(), "NaN is not"),
        (
            b'{"custom_id": "t", "method": "POST", "url": "/v1/chat/completions", "body": {"mes',
            "line 1",
        ),
    ):
        bad.write_bytes(content)
        result = _run(model_dir, str(bad), "-o", str(tmp_path / "o.jsonl"))
        assert result.exit_code == 2 and says in result.output, (content[:40], result.output)
        assert "Traceback" not in result.output and len(result.output.splitlines()) == 1
    result = _run(model_dir, str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 2 and "cannot read" in result.output
    # An output file of another input is not appended to.
    other = tmp_path / "other.jsonl"
    other.write_text('{"custom_id": "zzz"}\n')
    _write(bad, [_line("a", "hi")])
    result = _run(model_dir, str(bad), "-o", str(other))
    assert result.exit_code == 2 and "zzz" in result.output
    assert not (tmp_path / "o.jsonl").exists()
