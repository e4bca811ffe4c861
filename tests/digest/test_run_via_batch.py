"""`digest run --via batch` against our live server's Batch API (loopback, a tiny random model):
the night's summaries and reviews go as one batch, the run records its id, and the replies are
stored exactly as the streaming path stores them. A digest killed (kill -9) while it waits is
resumed by the next run, which polls the same batch rather than submitting again. SQLite and
PostgreSQL (NIGHTSHIFT_TEST_DATABASE_URL) for the digest's store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import select, update

from digest import batch_calls, pipeline
from digest.batch_calls import BatchPlan
from digest.batch_client import BatchClient
from digest.pipeline import run_digest
from digest.prompts import SUMMARY_FREQUENCY_PENALTY, SUMMARY_RETRY_FREQUENCY_PENALTY
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from digest.store.schema import RunRow
from engine.server.batch_config import BatchConfig
from tests.digest.conftest import fresh_database
from tests.digest.fault_server import FaultServer
from tests.digest.looping_model import build_looping_model
from tests.digest.test_pipeline import DAY, options, write_papers
from tests.engine.server.live_server import build_chat_model, live_server

WAIT_S = 240
BATCH_POLL = dict(batch_poll_s=0.05, batch_max_poll_s=0.2, chat_read_timeout_s=120.0)
# The tiny models never stop a summary before max_tokens: 256 tokens of each were most of this
# file's time. 48 still holds a sentence said several times (the looping model's 9 tokens).
SHORT_SUMMARY_TOKENS = 48


@pytest.fixture
def short_summaries(monkeypatch):
    """Summaries capped at SHORT_SUMMARY_TOKENS in this process, streamed or batched alike. Not
    for a test whose run is resumed from a `digest run` process: that one asked the full 256,
    so the resumed run's requests would differ from its batch's and be asked again."""
    for module in (pipeline, batch_calls):
        monkeypatch.setattr(module, "SUMMARY_MAX_TOKENS", SHORT_SUMMARY_TOKENS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_chat_model(
        tmp_path_factory.mktemp("model") / "tiny", max_position_embeddings=2048
    )
    batch = BatchConfig(home=tmp_path_factory.mktemp("batches"), concurrency=4)
    with live_server(
        model, "tiny", app_options={"batch": batch}, max_model_len=2048, max_num_seqs=4
    ) as (url, engine):
        yield url, engine


def _batches(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/batches", timeout=10).json()["data"]


def _run(tmp_path, db_url, url, **extra):
    """The run options of the tests' night: the first two papers of test_pipeline's file."""
    run = options(tmp_path, db_url, f"{url}/v1", **{"model": "tiny", "concurrency": 2, **extra})
    lines = (tmp_path / "papers.jsonl").read_text().splitlines()[:2]
    (tmp_path / "two.jsonl").write_text("\n".join(lines) + "\n")
    run.source = str(tmp_path / "two.jsonl")
    return run


def _stored(db_url: str) -> dict:
    """What a run leaves, in the terms both paths must agree on."""
    store = DigestStore(open_database(db_url))
    digest = store.load_digest(DAY)
    calls = sorted(
        (c.paper_id, c.kind, c.status, c.prompt_tokens, c.completion_tokens, c.finish_reason)
        for c in store.calls()
    )
    entries = sorted((e.paper.arxiv_id, e.status, e.summary, e.review_raw) for e in digest.entries)
    return {"calls": calls, "entries": entries}


def test_digest_via_batch_stores_what_streaming_stores(server, tmp_path, db_url, short_summaries):
    url, _ = server
    before = len(_batches(url))
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    batches = _batches(url)
    assert len(batches) == before + 1
    batch = batches[0]
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    with open_database(db_url).connect() as conn:
        (run,) = conn.execute(select(RunRow)).all()
    assert run.batch_id == batch["id"] and run.params["via"] == "batch"
    via_batch = _stored(db_url)
    for _, _, status, prompt, completion, _ in via_batch["calls"]:
        assert status == "ok" and prompt > 100 and completion > 0
    # The same night streamed, into a fresh store: the same rows, token for token.
    streamed_db = fresh_database(db_url, tmp_path / "streamed.db")
    streamed_dir = tmp_path / "streamed"
    streamed_dir.mkdir()
    write_papers(streamed_dir / "papers.jsonl")
    run_digest(_run(streamed_dir, streamed_db, url))
    assert _stored(streamed_db) == via_batch
    assert len(_batches(url)) == before + 1  # streaming submitted nothing


def _digest_cli(tmp_path, db_url: str, url: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "nightshift.cli", "digest", "run", "--date", DAY.isoformat(),
        "--source", str(tmp_path / "two.jsonl"), "--endpoint", f"{url}/v1", "--model", "tiny",
        "--via", "batch", "--db", db_url, "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _batch_id(db_url: str) -> str | None:
    try:
        with open_database(db_url).connect() as conn:
            return conn.execute(select(RunRow.batch_id)).scalars().first()
    except Exception:  # noqa: BLE001 - the schema is not there yet
        return None


def test_killed_digest_resumes_polling_the_same_batch(server, tmp_path, db_url):
    url, engine = server
    _run(tmp_path, db_url, url)  # writes two.jsonl
    slow = lambda *_: time.sleep(0.01)  # noqa: E731 - the batch outlives the kill
    engine.step_observers.append(slow)
    try:
        digest = _digest_cli(tmp_path, db_url, url)
        deadline = time.monotonic() + WAIT_S
        while (batch_id := _batch_id(db_url)) is None:
            assert digest.poll() is None, digest.stderr.read().decode()
            assert time.monotonic() < deadline, "the run never recorded its batch"
            time.sleep(0.05)
        os.kill(digest.pid, signal.SIGKILL)
        digest.wait(10)
        status = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10).json()["status"]
        assert status in ("validating", "in_progress")  # killed while the batch ran
    finally:
        engine.step_observers.remove(slow)
    before = len(_batches(url))
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    assert len(_batches(url)) == before  # polled, not submitted again
    with open_database(db_url).connect() as conn:
        runs = conn.execute(select(RunRow.status, RunRow.batch_id).order_by(RunRow.id)).all()
    assert [tuple(r) for r in runs] == [("interrupted", batch_id), ("succeeded", batch_id)]
    stored = _stored(db_url)
    assert len(stored["calls"]) == 4  # one record per request, none twice
    assert all(status == "done" for _, status, _, _ in stored["entries"])


class _Killed(BaseException):
    """The process dies here: nothing after this point runs, nothing is cleaned up."""


def _as_killed(db_url: str) -> None:
    """The run record as a kill -9 leaves it (still 'running'): the next run marks it
    interrupted, as it would after a real crash."""
    with open_database(db_url).begin() as conn:
        conn.execute(update(RunRow).values(status="running", finished_at=None, error=None))


def _dies_at(monkeypatch, owner: type, name: str, tmp_path, db_url: str, url: str) -> None:
    """A `--via batch` run that dies (as under kill -9) when it calls owner.name."""

    async def die(*_, **__):
        raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(owner, name, die)
        with pytest.raises(_Killed):
            run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    _as_killed(db_url)


def _new(url: str, before: set[str], kind: str = "batches") -> list[dict]:
    data = httpx.get(f"{url}/v1/{kind}", params={"limit": 100}, timeout=10).json()["data"]
    return [b for b in data if b["id"] not in before]


def test_a_run_killed_before_recording_its_batch_resumes_it(
    server, tmp_path, db_url, monkeypatch, short_summaries
):
    """Killed between creating the batch and storing its id on the run record: the next run
    finds the batch by its metadata (date, run, input hash) and polls it; nothing twice."""
    url, _ = server
    before = {b["id"] for b in _new(url, set())}
    files_before = {f["id"] for f in _new(url, set(), "files")}

    def die(*_):
        raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(DigestStore, "set_run_batch", die)
        with pytest.raises(_Killed):
            run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    _as_killed(db_url)
    [orphan] = _new(url, before)
    assert orphan["metadata"]["nightshift_digest_date"] == DAY.isoformat()
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    assert [b["id"] for b in _new(url, before)] == [orphan["id"]]  # not submitted again
    assert len(_new(url, files_before, "files")) == 2  # its input and output, once each
    with open_database(db_url).connect() as conn:
        runs = conn.execute(select(RunRow.status, RunRow.batch_id).order_by(RunRow.id)).all()
    assert [tuple(r) for r in runs] == [("interrupted", None), ("succeeded", orphan["id"])]
    assert len(_stored(db_url)["calls"]) == 4


def test_a_batch_recorded_two_runs_back_is_resumed(
    server, tmp_path, db_url, monkeypatch, short_summaries
):
    """Run 1 records its batch and dies while polling; run 2 dies before it reaches the batch;
    run 3 polls run 1's batch (not only the previous run's record is looked at)."""
    url, _ = server
    before = {b["id"] for b in _new(url, set())}

    for owner, name in ((BatchClient, "wait"), (BatchPlan, "run")):  # run 1, then run 2
        _dies_at(monkeypatch, owner, name, tmp_path, db_url, url)
    [batch] = _new(url, before)
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    assert [b["id"] for b in _new(url, before)] == [batch["id"]]
    with open_database(db_url).connect() as conn:
        runs = conn.execute(select(RunRow.status, RunRow.batch_id).order_by(RunRow.id)).all()
    assert [tuple(r) for r in runs] == [
        ("interrupted", batch["id"]),
        ("interrupted", None),
        ("succeeded", batch["id"]),
    ]


def test_a_resumed_batch_answers_only_the_requests_it_asked(
    server, tmp_path, db_url, monkeypatch, short_summaries
):
    """Between the dead run and the next, the summaries' request changed (another limit, as a
    changed model or prompt would): the old batch's reviews are used, its summaries asked again."""
    url, _ = server
    before = {b["id"] for b in _new(url, set())}

    _dies_at(monkeypatch, BatchClient, "wait", tmp_path, db_url, url)
    monkeypatch.setattr(batch_calls, "SUMMARY_MAX_TOKENS", batch_calls.SUMMARY_MAX_TOKENS - 1)
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    second, first = _new(url, before)
    assert (first["request_counts"]["total"], second["request_counts"]["total"]) == (4, 2)
    asked = httpx.get(f"{url}/v1/files/{second['input_file_id']}/content", timeout=10).text
    assert {json.loads(x)["custom_id"].split(":")[0] for x in asked.splitlines()} == {"summary"}


@pytest.mark.parametrize("gone", ["input_file_id", "output_file_id"])
def test_a_dead_runs_batch_whose_files_are_gone_is_asked_again(
    server, tmp_path, sqlite_url, monkeypatch, gone, short_summaries
):
    """The dead run's batch finished, then its input (or output) file was deleted on the
    server: the next run asks again instead of failing on the 404 (every night, as each
    failed run left the same batch to resume)."""
    url, _ = server

    _dies_at(monkeypatch, BatchClient, "wait", tmp_path, sqlite_url, url)
    batch_id = _batch_id(sqlite_url)
    deadline = time.monotonic() + WAIT_S
    while (batch := httpx.get(f"{url}/v1/batches/{batch_id}").json())["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.delete(f"{url}/v1/files/{batch[gone]}").json()["deleted"]
    report = run_digest(_run(tmp_path, sqlite_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)


def test_a_run_killed_between_upload_and_create_reuses_its_file(
    server, tmp_path, db_url, monkeypatch, short_summaries
):
    url, _ = server
    before = {b["id"] for b in _new(url, set())}
    files_before = {f["id"] for f in _new(url, set(), "files")}

    _dies_at(monkeypatch, BatchClient, "create", tmp_path, db_url, url)
    [upload] = _new(url, files_before, "files")
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    [batch] = _new(url, before)
    assert batch["input_file_id"] == upload["id"]  # the upload of the killed run, once


def test_a_lost_create_reply_is_not_retried_into_a_second_batch(
    server, tmp_path, db_url, monkeypatch, short_summaries
):
    """POST /batches reaches the server, the reply is lost (a timeout): the retry must find
    the batch it made rather than make another."""
    url, _ = server
    before = {b["id"] for b in _new(url, set())}
    real = httpx.AsyncClient.request
    lost = []

    async def lose_first_create(self, method, path, *args, **kwargs):
        reply = await real(self, method, path, *args, **kwargs)
        if method == "POST" and str(path) == "batches" and not lost:
            lost.append(reply.json()["id"])
            raise httpx.ReadTimeout("the reply was lost")
        return reply

    monkeypatch.setattr(httpx.AsyncClient, "request", lose_first_create)
    report = run_digest(_run(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    assert [b["id"] for b in _new(url, before)] == lost


@pytest.fixture(scope="module")
def looping_server(tmp_path_factory):
    """Our server, with the Batch API, on a tiny model whose every reply loops."""
    model = build_looping_model(tmp_path_factory.mktemp("looping") / "tiny")
    batch = BatchConfig(home=tmp_path_factory.mktemp("looping-batches"), concurrency=4)
    with live_server(
        model, "tiny", app_options={"batch": batch}, max_model_len=2048, max_num_seqs=4
    ) as (url, engine):
        yield url, engine


def _one_paper(tmp_path, db_url, url, **extra):
    run = _run(tmp_path, db_url, url, **extra)
    lines = (tmp_path / "papers.jsonl").read_text().splitlines()[:1]
    (tmp_path / "one.jsonl").write_text(lines[0] + "\n")
    run.source = str(tmp_path / "one.jsonl")
    return run


def _asked(url: str, batch: dict) -> list[dict]:
    data = httpx.get(f"{url}/v1/files/{batch['input_file_id']}/content", timeout=10).text
    return [json.loads(line) for line in data.splitlines()]


def test_a_looping_summary_is_asked_once_more_in_a_second_batch(
    looping_server, tmp_path, sqlite_url, short_summaries
):
    """Issue 19: a `--via batch` night asks a looping summary once more under the stronger
    penalty, as a streamed night does: a second batch of just that summary; both calls are
    recorded, and the night stores what the streamed night stores."""
    url, _ = looping_server
    before = {b["id"] for b in _new(url, set())}
    report = run_digest(_one_paper(tmp_path, sqlite_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 1, 3)
    second, first = _new(url, before)
    assert (first["request_counts"]["completed"], second["request_counts"]["completed"]) == (2, 1)
    summary = next(r for r in _asked(url, first) if r["custom_id"].startswith("summary:"))
    (retry,) = _asked(url, second)
    assert retry["custom_id"] == "summary-retry:abstract:2603.00001"
    assert summary["body"]["frequency_penalty"] == SUMMARY_FREQUENCY_PENALTY
    assert retry["body"] == {
        **summary["body"],
        "frequency_penalty": SUMMARY_RETRY_FREQUENCY_PENALTY,
    }
    store = DigestStore(open_database(sqlite_url))
    calls = sorted((c.kind, c.status, c.completion_tokens) for c in store.calls(report.run_id))
    assert [call[:2] for call in calls] == [("review", "ok"), ("summary", "ok"), ("summary", "ok")]
    assert [tokens for _, _, tokens in calls[1:]] == [SHORT_SUMMARY_TOKENS] * 2
    assert store.runs_for(DAY)[0].batch_id == second["id"]
    # The same night streamed, into a fresh store: the same rows, call for call.
    streamed_dir = tmp_path / "streamed"
    streamed_dir.mkdir()
    write_papers(streamed_dir / "papers.jsonl")
    streamed_db = f"sqlite:///{tmp_path / 'streamed.db'}"
    run_digest(_one_paper(streamed_dir, streamed_db, url))
    assert _stored(streamed_db) == _stored(sqlite_url)


def test_a_run_killed_during_the_second_batch_resumes_both(
    looping_server, tmp_path, db_url, monkeypatch, short_summaries
):
    """Killed while the looping summary's second batch runs: the next run polls the first
    batch and the second, submits nothing, and records each of the three calls once."""
    url, _ = looping_server
    before = {b["id"] for b in _new(url, set())}
    real_wait = BatchClient.wait
    waits = []

    async def die_on_the_second(self, batch_id):
        waits.append(batch_id)
        if len(waits) == 2:
            raise _Killed
        return await real_wait(self, batch_id)

    with monkeypatch.context() as patch:
        patch.setattr(BatchClient, "wait", die_on_the_second)
        with pytest.raises(_Killed):
            run_digest(_one_paper(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    _as_killed(db_url)
    second, first = _new(url, before)
    assert [b["id"] for b in (first, second)] == waits
    assert [r["custom_id"] for r in _asked(url, second)] == ["summary-retry:abstract:2603.00001"]
    assert _stored(db_url)["calls"] == []  # the dead run stored nothing of the looping paper
    report = run_digest(_one_paper(tmp_path, db_url, url, via="batch", **BATCH_POLL))
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 1, 3)
    assert [b["id"] for b in _new(url, before)] == [second["id"], first["id"]]  # none new
    with open_database(db_url).connect() as conn:
        runs = conn.execute(select(RunRow.status, RunRow.batch_id).order_by(RunRow.id)).all()
    assert [tuple(r) for r in runs] == [("interrupted", second["id"]), ("succeeded", second["id"])]
    kinds = sorted(kind for _, kind, *_ in _stored(db_url)["calls"])
    assert kinds == ["review", "summary", "summary"]


def test_local_endpoint_via_batch_survives_a_kill(tmp_path, monkeypatch, sqlite_url):
    """`--endpoint local --via batch`: the local server serves the Batch API from
    $NIGHTSHIFT_HOME/batches; killed with its digest (kill -9), the next run's new local server
    picks the batch up where the first stopped, and the run polls it to the end."""
    home = tmp_path / "home"
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    model = build_chat_model(tmp_path / "tiny", max_position_embeddings=2048)
    run = _run(tmp_path, sqlite_url, "unused", endpoint="local", model=None, via="batch")
    run.local_model = str(model)
    cmd = [
        sys.executable, "-m", "nightshift.cli", "digest", "run", "--date", DAY.isoformat(),
        "--source", run.source, "--endpoint", "local", "--local-model", str(model),
        "--no-local-speculation", "--via", "batch", "--db", sqlite_url,
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    digest = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + WAIT_S
        while (batch_id := _batch_id(sqlite_url)) is None:
            assert digest.poll() is None, digest.stderr.read().decode()
            assert time.monotonic() < deadline, "the run never recorded its batch"
            time.sleep(0.05)
    finally:
        os.kill(digest.pid, signal.SIGKILL)
        digest.wait(10)
    batches = open_database(f"sqlite:///{home / 'batches' / 'batches.db'}")
    with batches.connect() as conn:
        (status,) = conn.exec_driver_sql("SELECT status FROM batches").scalars().all()
    assert status in ("validating", "in_progress")  # the server died with the batch unfinished
    for name, value in BATCH_POLL.items():
        setattr(run, name, value)
    report = run_digest(run)
    assert (report.status, report.papers_done, report.calls) == ("succeeded", 2, 4)
    with batches.connect() as conn:
        rows = conn.exec_driver_sql("SELECT id, status, completed FROM batches").all()
    assert [tuple(r) for r in rows] == [(batch_id, "completed", 4)]  # the one batch, finished
    with open_database(sqlite_url).connect() as conn:
        runs = conn.execute(select(RunRow.status, RunRow.batch_id).order_by(RunRow.id)).all()
    assert [tuple(r) for r in runs] == [("interrupted", batch_id), ("succeeded", batch_id)]


def test_an_endpoint_without_a_batch_api_fails_the_run_in_one_line(tmp_path, sqlite_url):
    with FaultServer() as stub:  # an OpenAI-compatible server with chat completions only
        cmd = [
            sys.executable, "-m", "nightshift.cli", "digest", "run", "--date", DAY.isoformat(),
            "--source", str(write_papers(tmp_path / "papers.jsonl")), "--endpoint",
            stub.base_url, "--model", "stub-model", "--via", "batch", "--db", sqlite_url,
            "--out", str(tmp_path / "out"),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has no Batch API" in errors[0] and "--via stream" in errors[0]
    assert "Traceback" not in done.stderr
    with open_database(sqlite_url).connect() as conn:
        (run,) = conn.execute(select(RunRow.status, RunRow.batch_id)).all()
    assert tuple(run) == ("failed", None)
