"""The digest against our real engine: `--endpoint local` starts `nightshift serve` (a tiny
random model with the default tokenizer) on loopback, the calls go through it, and it stops."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from digest.pipeline import run_digest
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from digest.store.schema import RunRow
from nightshift.digest_commands import LOCAL_SPECULATION
from tests.digest.test_pipeline import DAY, options, write_papers
from tests.engine.server.live_server import build_chat_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("model") / "tiny", max_position_embeddings=2048)


def test_local_endpoint_runs_our_server(tmp_path, sqlite_url, tiny_model):
    model = tiny_model
    run = options(
        tmp_path,
        sqlite_url,
        "local",
        model=None,
        local_model=str(model),
        concurrency=2,
        chat_read_timeout_s=120.0,
        local_server_args=LOCAL_SPECULATION,  # what `digest run` passes by default
    )
    run.source = str(tmp_path / "two.jsonl")
    lines = (tmp_path / "papers.jsonl").read_text().splitlines()[:2]
    (tmp_path / "two.jsonl").write_text("\n".join(lines) + "\n")

    report = run_digest(run)

    assert report.papers_done == 2 and report.calls == 4
    store = DigestStore(open_database(sqlite_url))
    calls = store.calls()
    assert {c.model for c in calls} == {"tiny"}  # the served name is the model folder's
    assert all(c.status == "ok" and c.endpoint.startswith("http://127.0.0.1:") for c in calls)
    for call in calls:
        assert call.prompt_tokens > 100 and 0 < call.completion_tokens <= call.max_tokens
        assert call.ttft_s is not None and call.ttft_s <= call.latency_s
    # The review repeats the summary's prefix (system text + paper): our prefix cache serves it.
    reviews = [c for c in calls if c.kind == "review"]
    assert all(c.cached_tokens >= 64 for c in reviews), [c.cached_tokens for c in reviews]
    # Each reply is kept as received, next to the validated review.
    digest = store.load_digest(DAY)
    assert all(e.review_raw for e in digest.entries)


# `digest run`'s options for a local endpoint, as `_run_options` takes them.
_LOCAL_RUN = dict(
    categories="cs.CL",
    max_papers=None,
    source="arxiv",
    input_mode="abstract",
    endpoint="local",
    model=None,
    api_key_env=None,
    concurrency=1,
    db=None,
    out=None,
    include_cross=False,
    max_input_chars=1000,
    site_url=None,
)


def test_local_speculation_is_on_unless_turned_off():
    from nightshift.digest_commands import _run_options

    common = _LOCAL_RUN
    assert _run_options(DAY, **common).local_server_args == ("--speculative", "ngram")
    assert _run_options(DAY, **common, local_speculation=False).local_server_args == ()


def test_threads_go_to_the_local_server_only(caplog):
    import typer

    from nightshift.digest_commands import _run_options, _say_local_threads

    common = _LOCAL_RUN
    caplog.set_level("INFO", logger="nightshift")
    args = _run_options(DAY, **common, threads=1).local_server_args
    assert args == ("--speculative", "ngram", "--threads", "1")
    _say_local_threads("local", 1)
    assert caplog.messages[-1].startswith("local server torch threads: 1 (--threads; physical")
    # Without --threads the server takes its own default (the same cores), said at start too.
    assert "--threads" not in _run_options(DAY, **common).local_server_args
    _say_local_threads("local", None)
    assert caplog.messages[-1].startswith("local server torch threads: ")
    url = common | {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}
    assert "--threads" not in _run_options(DAY, **url, threads=2).local_server_args
    _say_local_threads(url["endpoint"], 2)
    assert "unused with --endpoint URL" in caplog.messages[-1]
    for bad in (0, -1):
        with pytest.raises(typer.Exit) as exit_info:
            _run_options(DAY, **common, threads=bad)
        assert exit_info.value.exit_code == 2


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc; zombies count as gone)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _port(pid: int) -> int:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--port") + 1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _cmdline(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


def test_digest_run_threads_reaches_the_local_server(tmp_path, tiny_model):
    """`digest run --threads 1 --endpoint local`: the server it starts has `--threads 1` on its
    command line, and the digest says so at start."""
    cmd = [
        sys.executable, "-m", "nightshift.cli", "digest", "run", "--date", DAY.isoformat(),
        "--source", str(write_papers(tmp_path / "papers.jsonl")), "--endpoint", "local",
        "--local-model", str(tiny_model), "--db", f"sqlite:///{tmp_path / 'digest.db'}",
        "--out", str(tmp_path / "out"), "--threads", "1",
    ]  # fmt: skip
    digest = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = None
    try:
        deadline = time.monotonic() + 120
        while server is None and time.monotonic() < deadline:
            assert digest.poll() is None, digest.stderr.read().decode()
            if children := _children(digest.pid):
                (server,) = children
            time.sleep(0.05)
        assert server is not None, "no local server was started"
        args = _cmdline(server)
        assert "serve" in args and args[args.index("--threads") + 1] == "1", args
    finally:
        digest.kill()  # the server dies with it (test_the_local_server_dies_with_the_digest)
        digest.wait()
        deadline = time.monotonic() + 10
        while server is not None and _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert server is None or not _alive(server)
    err = digest.stderr.read().decode()
    assert "local server torch threads: 1 (--threads; physical cores available:" in err, err


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_local_server_dies_with_the_digest(tmp_path, tiny_model, sig):
    db = f"sqlite:///{tmp_path / 'digest.db'}"
    cmd = [
        sys.executable, "-m", "nightshift.cli", "digest", "run", "--date", DAY.isoformat(),
        "--source", str(write_papers(tmp_path / "papers.jsonl")), "--endpoint", "local",
        "--local-model", str(tiny_model), "--db", db, "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    digest = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        server = port = None
        while time.monotonic() < deadline and not (port and _listening(port)):
            assert digest.poll() is None, digest.stderr.read().decode()
            if server is None and (children := _children(digest.pid)):
                (server,) = children
            if server is not None and port is None:
                port = _port(server)
            time.sleep(0.05)
        assert port and _listening(port), "the local server never listened"
        digest.send_signal(sig)
        digest.wait(10)
        deadline = time.monotonic() + 10
        while (_alive(server) or _listening(port)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), "the local server outlived the digest"
        assert not _listening(port)
    finally:
        digest.kill()
        digest.wait()
    assert digest.returncode == -sig
    if sig == signal.SIGTERM:
        # A stop unwinds like a failure: the run is recorded, and how to resume is said.
        assert b"stopped by SIGTERM" in digest.stderr.read()
        with open_database(db).connect() as conn:
            run = conn.execute(select(RunRow)).one()
        assert run.status == "failed" and "Terminated" in run.error
