"""`nightshift bench llamacpp` without llama.cpp: options, the ratio table from given figures, the
"no binary: skipped, exit 0" path, and a whole run against a tiny model of ours and a stand-in
llama-server (a small Python HTTP server that streams as llama.cpp does), so that the llama.cpp
side's start, requests and stop are exercised too."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from engine.server.llamacpp_bench import (
    LlamaCppBenchConfig,
    LlamaCppBenchError,
    Phase,
    format_table,
    llama_server_path,
    llamacpp_args,
    our_serve_args,
    phase_figures,
    ratio_rows,
    request_body,
    run_llamacpp_bench,
)
from nightshift.cli import app
from tests.engine.server.live_server import build_chat_model
from workload.metrics import RequestRecord

# Speaks just enough of llama-server: --version, GET /health, streamed POST /v1/completions with
# n_predict one-token chunks, then usage and [DONE]. It writes its argv to ARGV_FILE.
FAKE_LLAMA_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if "--version" in sys.argv:
    print("version: 0 (fake)")
    sys.exit(0)
args = sys.argv[1:]
with open(ARGV_FILE, "a") as f:
    f.write(json.dumps(args) + "\\n")
port = int(args[args.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["cache_prompt"] is False and body["ignore_eos"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = body["n_predict"]
        chunks = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(n)]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        chunks.append({"choices": [], "usage": usage})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\\n\\n")
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_llama_server(tmp_path: Path) -> tuple[Path, Path]:
    argv_file = tmp_path / "argv.jsonl"
    script = tmp_path / "llama-server"
    source = f"#!{sys.executable}\nARGV_FILE = {str(argv_file)!r}\n{FAKE_LLAMA_SERVER}"
    script.write_text(source)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, argv_file


def _phase(side: str, level: int, **figures: float) -> Phase:
    values = dict(
        makespan_s=10.0,
        output_tokens_per_s=100.0,
        median_ttft_s=0.5,
        median_decode_tokens_per_s=50.0,
    )
    values.update(figures)
    return Phase(side, level, 0, 8, 1024, 4000, **values)  # type: ignore[arg-type]


def test_ratios_are_above_one_when_we_are_faster():
    phases = [
        _phase("nightshift", 1, median_decode_tokens_per_s=60.0, median_ttft_s=0.2),
        _phase("llamacpp", 1, median_decode_tokens_per_s=120.0, median_ttft_s=0.4),
        _phase("nightshift", 8, output_tokens_per_s=300.0, makespan_s=5.0),
        _phase("llamacpp", 8, output_tokens_per_s=200.0, makespan_s=7.5),
    ]
    rows = {r.label: r for r in ratio_rows(phases)}
    assert rows["batch 1 decode"].ratio == pytest.approx(0.5)
    assert rows["batch 1 TTFT"].ours == pytest.approx(200.0)  # in ms
    assert rows["batch 1 TTFT"].ratio == pytest.approx(2.0)  # half the time: faster
    assert rows["concurrency 8 output"].ratio == pytest.approx(1.5)
    assert rows["concurrency 8 makespan"].ratio == pytest.approx(1.5)
    table = format_table(list(rows.values()))
    assert "0.50x" in table[1] and "1.50x" in table[3]


def test_ratio_rows_take_the_median_over_repeats_and_allow_one_side():
    phases = [_phase("nightshift", 1, median_decode_tokens_per_s=v) for v in (10.0, 30.0, 20.0)]
    (decode, ttft) = ratio_rows(phases)
    assert decode.ours == 20.0 and decode.theirs is None and decode.ratio is None
    assert format_table([decode])[1].split()[-2:] == ["-", "-"]


def test_a_short_or_failed_request_fails_the_phase():
    ok = RequestRecord(0, 10, 4, start_s=0.0, end_s=1.0, chunk_times=[0.1, 0.2, 0.3, 0.4])
    ok.output_received = 4
    short = RequestRecord(1, 10, 4, start_s=0.0, end_s=1.0, chunk_times=[0.1, 0.2])
    short.output_received = 2
    phase, raw = phase_figures("nightshift", 1, 0, [ok])
    assert phase.output_tokens == 4 and len(raw["requests"]) == 1
    assert phase.median_decode_tokens_per_s == pytest.approx(3 / 0.9)  # 3 tokens after 0.1 s
    with pytest.raises(LlamaCppBenchError, match="another token count"):
        phase_figures("llamacpp", 8, 0, [ok, short])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quantization": "int3"}, "quantization must be one of"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"concurrency": [0]}, "concurrency"),
        ({"model": "/some/folder"}, "--gguf"),
    ],
)
def test_bad_options_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        LlamaCppBenchConfig(**changes).check()
    LlamaCppBenchConfig(model="/some/folder", skip_llamacpp=True).check()  # ours only: fine


def test_the_binary_comes_from_the_option_then_the_environment(monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", "/env/llama-server")
    assert llama_server_path("/opt/llama-server") == Path("/opt/llama-server")
    assert llama_server_path(None) == Path("/env/llama-server")
    monkeypatch.delenv("LLAMA_SERVER")
    assert llama_server_path(None) == Path("/tmp/llamacpp/bin/llama-server")


def test_both_sides_get_the_same_request_and_their_own_options():
    ours = json.loads(request_body("nightshift", [1, 2, 3], 16))
    theirs = json.loads(request_body("llamacpp", [1, 2, 3], 16))
    for body in (ours, theirs):
        assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 16
        assert body["temperature"] == 0.0 and body["stream"] and body["ignore_eos"]
    assert theirs["n_predict"] == 16 and theirs["cache_prompt"] is False
    assert ours["min_tokens"] == 16
    args = our_serve_args(LlamaCppBenchConfig(), Path("/m"), 32)
    assert "--no-enable-prefix-caching" in args and "--quantization" not in args
    args = our_serve_args(LlamaCppBenchConfig(quantization="int8"), Path("/m"), 32)
    assert args[-2:] == ["--quantization", "int8"]
    cmd = llamacpp_args(Path("/b"), Path("/g.gguf"), 1234, 2, 8, 600)
    assert cmd[cmd.index("-c") + 1] == "4800" and cmd[cmd.index("-np") + 1] == "8"
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_no_binary_is_a_skip_with_exit_zero(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    missing = tmp_path / "llama-server"
    out = tmp_path / "r.json"
    args = ["bench", "llamacpp", "--llama-server", str(missing), "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1
    assert result.output.startswith("skipped:") and "ops/build_llamacpp.sh" in result.output
    assert "skipped" in json.loads(out.read_text())


def test_a_bad_option_is_one_line_and_exit_2(tmp_path):
    args = ["bench", "llamacpp", "--skip-llamacpp", "--quantization", "int3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "quantization must be one of" in result.output


def test_a_whole_run_against_our_server_and_a_stand_in_llama_server(tmp_path):
    # 2048 positions: the digest prompts are a few hundred tokens.
    model = build_chat_model(tmp_path / "m", max_position_embeddings=2048)
    binary, argv_file = _fake_llama_server(tmp_path)
    gguf = tmp_path / "model.gguf"  # the stand-in reads nothing; the roofline its tensors' sizes
    _write_gguf(gguf, {"a": (64, 96), "b": (7,)})
    cfg = LlamaCppBenchConfig(
        model=str(model),
        gguf=str(gguf),
        llama_server=str(binary),
        num_prompts=3,
        batch1_prompts=2,
        max_tokens=4,
        concurrency=[2],
        threads=1,
        json_out=str(tmp_path / "r.json"),
    )
    lines: list[str] = []
    report = run_llamacpp_bench(cfg, echo=lines.append)
    assert json.loads((tmp_path / "r.json").read_text())["threads"] == 1
    by_side = {(p["side"], p["concurrency"]): p for p in report["phases"]}
    assert set(by_side) == {(s, c) for s in ("nightshift", "llamacpp") for c in (1, 2)}
    for (_, level), phase in by_side.items():
        assert phase["requests"] == (2 if level == 1 else 3)
        assert phase["output_tokens"] == phase["requests"] * 4
    # The same token ids went to both servers.
    assert by_side["nightshift", 2]["prompt_tokens"] == by_side["llamacpp", 2]["prompt_tokens"]
    assert not any(line.startswith("note:") for line in lines)
    # One llama-server per phase, with that phase's slots, on loopback; all stopped.
    starts = [json.loads(line) for line in argv_file.read_text().splitlines()]
    assert [a[a.index("-np") + 1] for a in starts] == ["1", "2"]
    for args in starts:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{args[args.index('--port') + 1]}/health", timeout=2)
    assert report["commands"]["nightshift"][0] == "OMP_NUM_THREADS=1"
    assert {row["label"] for row in report["table"]} >= {"batch 1 decode", "concurrency 2 output"}
    assert all(row["ratio"] is not None for row in report["table"])
    # The batch-1 roofline: the GGUF's bytes and the K/V at the mean context, per side.
    roof = report["batch1_roofline"]
    assert roof["weight_bytes"] == 4 * (64 * 96 + 7)
    assert roof["step_bytes"]["nightshift"] > roof["step_bytes"]["llamacpp"] > roof["weight_bytes"]
    assert set(roof["fractions"]) == {"nightshift", "llamacpp"}
    assert any(line.startswith("batch 1 roofline:") for line in lines)


def _write_gguf(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, shape in shapes.items():
        writer.add_tensor(name, np.ones(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_that_is_not_a_gguf_is_named(tmp_path):
    from engine.server.llamacpp_bench import batch1_roofline

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a GGUF file"):
        batch1_roofline(bad, tmp_path, [10], 4, 1)
