"""The Batch API on a live server (loopback, a tiny random model), driven by the official openai
client as a cloud Batch API caller drives it: files.create, batches.create, batches.retrieve,
files.content; whole-file validation with line numbers, duplicate custom_ids, limits, the API
key, cancel mid-batch, expiry, priority below interactive traffic, and /metrics progress."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from engine.server.batch_config import BatchConfig
from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"
KEY = "secret"
WAIT_S = 90  # every wait below is bounded by this


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("batch-model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("batch-home")
    batch = BatchConfig(home=home, max_lines=40, max_file_bytes=64 << 10, concurrency=2)
    with live_server(
        model_dir, MODEL, api_key=KEY, app_options={"batch": batch}, max_model_len=256,
        max_num_seqs=4,
    ) as (url, engine):  # fmt: skip
        yield url, engine, home


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=30, max_retries=0)


def _chat_line(custom_id: str, content: str, max_tokens: int = 8, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _jsonl(lines: list) -> bytes:
    return b"".join(
        (ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines
    )


def _submit(client: openai.OpenAI, lines: list, window: str = "24h", **kwargs):
    upload = client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id,
        endpoint=kwargs.pop("endpoint", "/v1/chat/completions"),
        completion_window=window,
        **kwargs,
    )


def _wait(client: openai.OpenAI, batch_id: str, statuses: set[str], until=None):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {WAIT_S} s")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


def test_openai_client_round_trip(server):
    url, _, _ = server
    client = _client(url)
    lines = [_chat_line(f"req-{i}", f"Tell me about item {i}.") for i in range(5)]
    created = _submit(client, lines, metadata={"night": "2026-12-04"})
    assert created.status == "validating" and created.metadata == {"night": "2026-12-04"}
    done = _wait(client, created.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    assert done.request_counts.total == 5 and done.request_counts.completed == 5
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    results = {r["custom_id"]: r for r in _lines(client, done.output_file_id)}
    assert sorted(results) == [f"req-{i}" for i in range(5)]
    # Each line's body is what the same request over HTTP answers (greedy: the same text).
    direct = client.chat.completions.create(**lines[3]["body"])
    line = results["req-3"]
    assert line["error"] is None and line["response"]["status_code"] == 200
    body = line["response"]["body"]
    assert body["object"] == "chat.completion" and line["response"]["request_id"] == body["id"]
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    # Files and batches are listed and retrievable; the output file is the server's own.
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.bytes > 0
    assert created.id in [b.id for b in client.batches.list()]
    assert done.input_file_id in [f.id for f in client.files.list()]


def test_completions_endpoint_and_failed_lines(server):
    url, _, _ = server
    client = _client(url)
    ok = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": ok},
        # Valid in shape, refused by the endpoint when it runs (longer than the context).
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**ok, "max_tokens": 100_000},
        },
    ]
    batch = _submit(client, lines, endpoint="/v1/completions")
    done = _wait(client, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [good] = _lines(client, done.output_file_id)
    [bad] = _lines(client, done.error_file_id)
    assert good["custom_id"] == "ok" and good["response"]["body"]["object"] == "text_completion"
    assert bad["custom_id"] == "too-long" and bad["response"]["status_code"] == 400
    assert "max_tokens" in bad["response"]["body"]["error"]["message"]


def test_bad_lines_fail_the_batch_with_line_numbers(server):
    url, engine, _ = server
    client = _client(url)
    good = _chat_line("a", "hi")
    lines = [
        good,
        b'{"custom_id": "b", "method": "POST", ',  # line 2: cut short
        {**_chat_line("c", "hi"), "custom_id": ""},  # line 3: empty custom_id
        {**_chat_line("d", "hi"), "url": "/v1/completions"},  # line 4: another endpoint
        _chat_line("e", "hi", temperature="hot"),  # line 5: the endpoint would refuse it
        b"[1, 2]",  # line 6: not an object
        _chat_line("g", "hi", stream=True),  # line 7: a batch line cannot stream
        b"[" * 50_000,  # line 8: deeper than any parser should follow
        b'{"custom_id": ' + b"9" * 5000 + b"}",  # line 9: an absurd number
    ]
    submitted_before = engine.stats().num_running + engine.num_waiting
    batch = _submit(client, lines)
    failed = _wait(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and failed.failed_at
    errors = failed.errors.data
    assert [e.line for e in errors] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert errors[0].code == "invalid_json_line"
    assert errors[1].param == "custom_id"
    assert errors[2].code == "invalid_url"
    assert errors[3].param == "body.temperature"
    assert "stream" in errors[5].message
    # Nothing ran: no output, no counts.
    assert failed.output_file_id is None and failed.request_counts.completed == 0
    assert engine.stats().num_running + engine.num_waiting == submitted_before


def test_duplicate_custom_id_refused(server):
    url, _, _ = server
    client = _client(url)
    lines = [_chat_line("x", "one"), _chat_line("y", "two"), _chat_line("x", "three")]
    failed = _wait(client, _submit(client, lines).id, {"failed", "completed"})
    assert failed.status == "failed"
    [error] = failed.errors.data
    assert error.code == "duplicate_custom_id" and error.line == 3
    assert "line 1" in error.message


def test_limits_and_bad_requests(server):
    url, _, _ = server
    client = _client(url)
    # More lines than --batch-max-lines (40 here): refused whole.
    many = [_chat_line(f"n{i}", "hi") for i in range(41)]
    failed = _wait(client, _submit(client, many).id, {"failed", "completed"})
    assert failed.status == "failed" and failed.errors.data[0].code == "too_many_requests"
    # A file over --batch-max-file-bytes (64 KiB here): a 413 at upload.
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("big.jsonl", b"x" * (80 << 10)), purpose="batch")
    assert err.value.status_code == 413 and "--batch-max-file-bytes" in err.value.message
    upload = client.files.create(
        file=("in.jsonl", _jsonl([_chat_line("a", "hi")])), purpose="batch"
    )
    for bad, param in (
        ({"endpoint": "/v1/images"}, "endpoint"),
        ({"completion_window": "forever"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
    ):
        args = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions"}
        args |= {"completion_window": "24h"} | bad
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(**args)
        assert err.value.body["param"] == param
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        bad_purpose = http.post("/v1/files", files={"file": ("a", b"{}")}, data={"purpose": "x"})
        assert bad_purpose.status_code == 400 and "purpose" in bad_purpose.text
        not_multipart = http.post("/v1/files", content=b"plain")
        assert not_multipart.status_code == 400
        assert http.get("/v1/batches/batch_nope").status_code == 404
        assert http.get("/v1/files/file-nope/content").status_code == 404
        # The server still serves after all of that.
        assert http.get("/v1/models").status_code == 200


def test_api_key_applies(server):
    url, _, _ = server
    with httpx.Client(base_url=url) as http:
        for method, path in (
            ("POST", "/v1/files"),
            ("GET", "/v1/files"),
            ("POST", "/v1/batches"),
            ("GET", "/v1/batches"),
        ):
            assert http.request(method, path).status_code == 401


def test_delete_file(server):
    url, _, home = server
    client = _client(url)
    upload = client.files.create(file=("d.jsonl", b"{}\n"), purpose="batch")
    assert (home / upload.id).exists()
    assert client.files.delete(upload.id).deleted
    assert not (home / upload.id).exists()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def _slow_steps(engine, seconds: float):
    slow = lambda *_: time.sleep(seconds)  # noqa: E731 - steps slow enough to act mid-batch
    engine.step_observers.append(slow)
    return slow


def test_cancel_mid_batch_aborts_lines_in_flight(server):
    url, engine, _ = server
    client = _client(url)
    lines = [_chat_line(f"c{i}", "Go on.", max_tokens=30, ignore_eos=True) for i in range(10)]
    slow = _slow_steps(engine, 0.01)
    try:
        batch = _submit(client, lines)
        _wait(client, batch.id, set(), until=lambda b: b.request_counts.completed >= 1)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = _wait(client, batch.id, {"cancelled"})
    finally:
        engine.step_observers.remove(slow)
    assert done.cancelled_at and done.cancelling_at
    counts = done.request_counts
    assert 1 <= counts.completed < 10 and counts.failed == 0
    ids = [r["custom_id"] for r in _lines(client, done.output_file_id)]
    assert len(ids) == counts.completed == len(set(ids))
    # The lines in flight left the engine: nothing of the batch runs on.
    deadline = time.monotonic() + 10
    while engine.stats().num_running + engine.num_waiting and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().num_running + engine.num_waiting == 0
    with pytest.raises(openai.APIStatusError) as err:
        client.batches.cancel(batch.id)
    assert err.value.status_code == 409


def test_expiry_writes_unrun_lines_as_expired(server):
    url, engine, _ = server
    client = _client(url)
    lines = [_chat_line(f"e{i}", "More.", max_tokens=40, ignore_eos=True) for i in range(12)]
    slow = _slow_steps(engine, 0.02)
    try:
        done = _wait(client, _submit(client, lines, window="2s").id, {"expired", "completed"})
    finally:
        engine.step_observers.remove(slow)
    assert done.status == "expired" and done.expired_at
    finished = _lines(client, done.output_file_id)
    errors = _lines(client, done.error_file_id)
    expired = [e for e in errors if e["error"] and e["error"]["code"] == "batch_expired"]
    assert expired and len(expired) == len(errors)  # every unfinished line, none twice
    ids = [r["custom_id"] for r in finished + errors]
    assert sorted(ids) == sorted(f"e{i}" for i in range(12))
    assert done.request_counts.completed == len(finished)
    assert done.request_counts.failed == len(errors)


def test_batch_runs_below_interactive_traffic_and_shows_in_metrics(server):
    url, engine, _ = server
    client = _client(url)
    lines = [_chat_line(f"p{i}", "Slowly.", max_tokens=40, ignore_eos=True) for i in range(8)]
    most_running = [0]

    def watch(*_):
        most_running[0] = max(most_running[0], engine.stats().num_running)
        time.sleep(0.005)

    engine.step_observers.append(watch)
    try:
        batch = _submit(client, lines)
        _wait(client, batch.id, set(), until=lambda b: b.status == "in_progress")
        with httpx.Client(base_url=url) as http:
            deadline = time.monotonic() + WAIT_S
            text = ""
            while 'state="running"' not in text and time.monotonic() < deadline:
                text = http.get("/metrics").text
                time.sleep(0.02)
        assert f'nightshift:batch_requests{{batch_id="{batch.id}",state="total"}} 8.0' in text
        assert most_running[0] <= 2  # --batch-concurrency
        # An interactive request is answered while the batch still runs.
        answer: list = []
        thread = threading.Thread(
            target=lambda: answer.append(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Now."}], max_tokens=4
                )
            )
        )
        thread.start()
        thread.join(WAIT_S)
        during = client.batches.retrieve(batch.id)
        assert answer and during.status == "in_progress"
        assert during.request_counts.completed < 8
        done = _wait(client, batch.id, {"completed"})
    finally:
        engine.step_observers.remove(watch)
    assert done.request_counts.completed == 8
    assert most_running[0] <= 3  # two batch lines and the interactive one
    with httpx.Client(base_url=url) as http:
        text = http.get("/metrics").text
    assert 'nightshift:batch_lines_finished_total{outcome="completed"}' in text


def test_a_full_waiting_queue_delays_lines_instead_of_failing_them(model_dir, tmp_path):
    # One running slot, one waiting place: the third line in flight gets a 429 from the engine's
    # admission, and must wait for room rather than land in the error file.
    batch = BatchConfig(home=tmp_path, concurrency=3)
    with live_server(
        model_dir, MODEL, max_waiting_requests=1, app_options={"batch": batch},
        max_model_len=256, max_num_seqs=1,
    ) as (url, _):  # fmt: skip
        client = _client(url)
        lines = [_chat_line(f"q{i}", "Wait.", max_tokens=16, ignore_eos=True) for i in range(6)]
        done = _wait(client, _submit(client, lines).id, {"completed", "failed"})
        with httpx.Client(base_url=url) as http:
            metrics = http.get("/metrics").text
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
    rejected = re.search(
        r'nightshift:request_rejected_total\{[^}]*code="queue_full"[^}]*\} (\S+)', metrics
    )
    assert rejected and float(rejected.group(1)) > 0  # the 429s did happen


def test_lists_page_newest_first(server):
    url, _, _ = server
    client = _client(url)
    ids = [client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(3)]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        first = http.get("/v1/files", params={"limit": 2, "purpose": "batch"}).json()
        assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"]
        rest = http.get("/v1/files", params={"limit": 2, "after": first["last_id"]}).json()
        assert rest["data"][0]["id"] == ids[0]
        assert http.get("/v1/files", params={"limit": 0}).status_code == 400
        assert http.get("/v1/files", params={"after": "file-nope"}).json()["data"] == []
    page = client.batches.list(limit=1)
    assert len(page.data) == 1 and page.has_more


def test_an_interactive_request_goes_before_a_waiting_batch_line(model_dir, tmp_path):
    # One sequence slot, two batch lines in flight: one runs, one waits at the batch priority.
    # A chat request arriving after both takes the slot first (priority 0 before 10).
    batch = BatchConfig(home=tmp_path, concurrency=2)
    with live_server(
        model_dir, MODEL, app_options={"batch": batch}, max_model_len=256, max_num_seqs=1
    ) as (url, engine):
        client = _client(url)
        slow = _slow_steps(engine, 0.01)
        try:
            lines = [_chat_line(f"b{i}", "Long.", max_tokens=40, ignore_eos=True) for i in (0, 1)]
            submitted = _submit(client, lines)
            deadline = time.monotonic() + WAIT_S
            while not (engine.stats().num_running == 1 and engine.num_waiting == 1):
                assert time.monotonic() < deadline, "the batch lines never queued"
                time.sleep(0.005)
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Now."}], max_tokens=4
            )
            journal = tmp_path / f"{submitted.id}.output.jsonl"
            finished_before = len(journal.read_text().splitlines())
        finally:
            engine.step_observers.remove(slow)
        done = _wait(client, submitted.id, {"completed"})
    assert answer.choices[0].message.content is not None
    assert finished_before == 1  # the running line, not the waiting one
    assert done.request_counts.completed == 2


def test_servers_sharing_a_batch_database_run_each_batch_once(model_dir, tmp_path):
    # Two servers on one database and home (replicas on one PostgreSQL, say): both take
    # batches, the first started runs them; once it stops, the other takes over.
    batch = BatchConfig(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'shared.db'}")
    options = dict(app_options={"batch": batch}, max_model_len=256)
    first, second = (
        live_server(model_dir, MODEL, **options),
        live_server(model_dir, MODEL, **options),
    )
    first_url, _ = first.__enter__()
    try:
        time.sleep(0.5)  # the first server's runner takes the lease
        second_url, _ = second.__enter__()
        try:
            client = _client(second_url)
            lines = [_chat_line(f"s{i}", "Hi.") for i in range(3)]
            assert _wait(client, _submit(client, lines).id, {"completed"})
            assert (_finished_lines(first_url), _finished_lines(second_url)) == (3, 0)
            first.__exit__(None, None, None)  # its lease is released as it stops
            first = None
            done = _wait(client, _submit(client, lines).id, {"completed"})
            assert done.request_counts.completed == 3 and _finished_lines(second_url) == 3
        finally:
            second.__exit__(None, None, None)
    finally:
        if first is not None:
            first.__exit__(None, None, None)


def _finished_lines(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r'nightshift:batch_lines_finished_total\{outcome="completed"\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def test_embeddings_endpoint(server):
    url, _, _ = server
    client = _client(url)
    lines = [
        {"custom_id": f"v{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
        for i, text in enumerate(["a paper", "another paper"])
    ]
    done = _wait(client, _submit(client, lines, endpoint="/v1/embeddings").id, {"completed"})
    results = {r["custom_id"]: r["response"]["body"] for r in _lines(client, done.output_file_id)}
    direct = client.embeddings.create(model=MODEL, input="another paper")
    assert results["v1"]["data"][0]["embedding"] == pytest.approx(direct.data[0].embedding)


def test_nan_and_infinity_are_not_json(server):
    """Python's parser takes NaN and Infinity (and reads 1e999 as infinity); JSON has neither,
    and such a body cannot be sent on as JSON. Such a line once passed validation, failed as it
    was sent, and vanished: a batch 'completed' with neither an output nor an error line."""
    url, _, _ = server
    client = _client(url)
    lines = [
        json.dumps(_chat_line(name, "hi")).replace('"temperature": 0', f'"temperature": {value}')
        for name, value in (("nan", "NaN"), ("inf", "-Infinity"), ("big", "1e999"))
    ]
    lines = [line.encode() for line in lines] + [_chat_line("fine", "hi")]
    failed = _wait(client, _submit(client, lines).id, {"failed", "completed"})
    assert failed.status == "failed", failed.request_counts
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (1, "invalid_json_line"),
        (2, "invalid_json_line"),
        (3, "invalid_json_line"),
    ]
    assert "NaN" in failed.errors.data[0].message and "1e999" in failed.errors.data[2].message


def test_a_line_that_cannot_be_sent_ends_in_the_error_file(server, monkeypatch):
    """Whatever stops a line from being sent, it ends as an error line, counted: a batch never
    finishes with a request missing from both files."""
    url, _, _ = server
    client = _client(url)
    real = httpx.AsyncClient.post

    async def post(self, path, *args, **kwargs):
        if "boom" in json.dumps(kwargs.get("json")):
            raise RuntimeError("cannot send")
        return await real(self, path, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "post", post)
    lines = [_chat_line("good", "hi"), _chat_line("bad", "boom")]
    done = _wait(client, _submit(client, lines).id, {"failed", "completed"})
    assert done.status == "completed"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (2, 1, 1)
    [bad] = _lines(client, done.error_file_id)
    assert bad["custom_id"] == "bad" and bad["response"] is None
    assert bad["error"]["code"] == "request_failed" and "cannot send" in bad["error"]["message"]


def test_files_list_order(server):
    """The openai client's files.list(order="asc"): oldest first, paged with `after`."""
    url, _, _ = server
    client = _client(url)
    ids = [client.files.create(file=(f"o{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(3)]
    newest = client.files.list(order="desc", limit=3, purpose="batch").data
    assert [f.id for f in newest] == ids[::-1]
    everything = client.files.list(order="asc", purpose="batch").data
    assert [f.id for f in everything][-3:] == ids
    first = client.files.list(order="asc", limit=2, purpose="batch")
    assert [f.id for f in first.data] == [f.id for f in everything][:2] and first.has_more
    rest = client.files.list(order="asc", after=first.data[-1].id, purpose="batch").data
    assert [f.id for f in rest] == [f.id for f in everything][2:]
    with pytest.raises(openai.BadRequestError):
        client.files.list(order="sideways")
