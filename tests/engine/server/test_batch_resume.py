"""A server killed with `kill -9` (or stopped by SIGTERM) mid-batch resumes after its restart:
the lines it had finished are kept byte for byte and never run again, the rest run once, and the
output file holds every custom_id exactly once. Batch records on SQLite, and on PostgreSQL when
NIGHTSHIFT_TEST_DATABASE_URL names one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine.server.server_process import free_loopback_port, start_server_process
from tests.digest.conftest import PG_URL, fresh_database
from tests.engine.server.live_server import build_chat_model

LINES = 12
WAIT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("resume-model"))


def _serve(model_dir, database_url: str):
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--max-model-len", "256"]
    args += ["--enable-batch-api", "--batch-database-url", database_url]
    args += ["--batch-concurrency", "1"]
    return start_server_process(args, timeout_s=WAIT_S)


def _complete_lines(path) -> list[bytes]:
    data = path.read_bytes() if path.exists() else b""
    return data[: data.rfind(b"\n") + 1].splitlines(keepends=True)


@pytest.mark.parametrize(
    ("backend", "sig"),
    [
        pytest.param("sqlite", signal.SIGKILL, id="sqlite-kill-9"),
        pytest.param("postgresql", signal.SIGKILL, id="postgresql-kill-9"),
        pytest.param("sqlite", signal.SIGTERM, id="sqlite-sigterm"),
    ],
)
def test_a_server_stopped_mid_batch_resumes_without_redoing_or_duplicating(
    backend, sig, model_dir, tmp_path, monkeypatch
):
    """SIGTERM too: a graceful stop drops the lines in flight unjournaled, exits 0, and the
    restart runs them."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'batches.db'}"
    elif PG_URL:
        url = fresh_database(PG_URL, tmp_path / "unused.db")
    else:
        pytest.skip("NIGHTSHIFT_TEST_DATABASE_URL is not set")
    home = tmp_path / "home"
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))  # the servers' file bodies
    body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 64}
    body |= {"ignore_eos": True, "temperature": 0}
    requests = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(LINES)
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in requests)

    server = _serve(model_dir, url)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", timeout=30, max_retries=0)
        upload = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        journal = home / "batches" / f"{batch.id}.output.jsonl"
        deadline = time.monotonic() + WAIT_S
        while len(_complete_lines(journal)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(server.proc.pid, sig)
        assert server.proc.wait(60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    finally:
        server.stop()
    before = _complete_lines(journal)
    assert 2 <= len(before) < LINES, "the kill must land mid-batch"

    server = _serve(model_dir, url)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", timeout=30, max_retries=0)
        deadline = time.monotonic() + WAIT_S
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, f"still {done.status}"
            time.sleep(0.05)
        output = client.files.content(done.output_file_id).content
        metrics = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    finally:
        server.stop()
    ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(LINES))  # each once
    assert done.request_counts.completed == LINES and done.request_counts.failed == 0
    # The lines finished before the kill are the file's first lines, unchanged...
    assert output.splitlines(keepends=True)[: len(before)] == before
    # ...and the restarted server ran only the others.
    ran = f'nightshift:batch_lines_finished_total{{outcome="completed"}} {LINES - len(before)}.0'
    assert ran in metrics


def test_a_bad_batch_database_fails_the_start_in_one_line(model_dir, tmp_path):
    cmd = [sys.executable, "-m", "nightshift.cli", "serve", "--model", str(model_dir)]
    port = str(free_loopback_port())
    cmd += ["--enable-batch-api", "--port", port, "--batch-database-url", "mysql://nobody@x/db"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: cannot open mysql://nobody@x/db: unsupported database; use sqlite:///PATH or "
        "postgresql+psycopg://USER@HOST/DB"
    ]
