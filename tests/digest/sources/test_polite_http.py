from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from digest.sources.polite_http import (
    HttpStatusError,
    PoliteClient,
    PoliteHttpConfig,
    SourceError,
    SourceUnreachable,
    retry_after_seconds,
)
from tests.digest.sources.scripted_server import Reply, ScriptedServer, refused_url


def test_sends_a_descriptive_user_agent_and_the_accept_header(server, client):
    server.script(Reply(body="ok"))
    response = client.get(server.url("/x"), params={"a": "1 2"}, accept="text/html")
    assert response.status_code == 200
    [request] = server.received
    assert request.headers["User-Agent"] == PoliteHttpConfig().user_agent
    assert "nightshift" in request.headers["User-Agent"]
    assert request.headers["Accept"] == "text/html"
    assert request.query == {"a": ["1 2"]}


def test_requests_are_spaced_by_the_minimum_interval(server, make_client):
    client = make_client(min_interval_s=0.1)
    server.script(Reply(), Reply(), Reply())
    for _ in range(3):
        client.get(server.url("/x"))
    gaps = server.gaps()
    assert len(gaps) == 2
    # Arrival times jitter by a connection setup (ms); unspaced requests arrive ~1 ms apart.
    assert min(gaps) >= 0.08


@pytest.mark.parametrize("status", [406, 429, 500, 502, 503, 504])
def test_transient_statuses_are_retried(server, client, status):
    server.script(Reply(status=status), Reply(body="fine"))
    response = client.get(server.url("/x"))
    assert (response.status_code, response.text) == (200, "fine")
    assert len(server.received) == 2


def test_retry_after_seconds_is_honoured(server, client):
    server.script(Reply(status=429, headers={"Retry-After": "1"}), Reply(body="fine"))
    assert client.get(server.url("/x")).text == "fine"
    # backoff_s is 0.01: only Retry-After explains a one-second wait.
    assert server.gaps()[0] >= 0.95


def test_retry_after_is_capped_by_max_backoff(server, make_client):
    client = make_client(max_backoff_s=0.05)
    server.script(Reply(status=503, headers={"Retry-After": "30"}), Reply(body="fine"))
    started = time.monotonic()
    assert client.get(server.url("/x")).text == "fine"
    assert time.monotonic() - started < 2.0
    assert server.gaps()[0] >= 0.045


def test_backoff_doubles_between_retries(server, make_client):
    client = make_client(max_retries=3, backoff_s=0.05)
    server.script(Reply(status=503), Reply(status=503), Reply(status=503), Reply(body="fine"))
    assert client.get(server.url("/x")).text == "fine"
    gaps = server.gaps()
    assert [gap >= expected for gap, expected in zip(gaps, [0.04, 0.08, 0.16])] == [True] * 3


def test_exhausted_retries_raise_a_clear_error(server, client):
    server.script(Reply(status=503), Reply(status=503), Reply(status=503), Reply(body="late"))
    url = server.url("/api/query")
    with pytest.raises(SourceError) as caught:
        client.get(url, params={"start": 0})
    assert not isinstance(caught.value, SourceUnreachable)
    assert str(caught.value) == f"{url}?start=0: HTTP 503 after 3 attempts"
    assert len(server.received) == 3


def test_connection_refused_raises_source_unreachable(client):
    url = refused_url()
    with pytest.raises(SourceUnreachable) as caught:
        client.get(url)
    assert str(caught.value).startswith(f"{url}: cannot connect (")
    assert str(caught.value).endswith("after 3 attempts")


def test_an_unresolvable_host_fails_at_once_without_retries(make_client):
    # `.invalid` never resolves (RFC 6761), as every host name does not without a network.
    client = make_client(backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(SourceUnreachable, match="export.arxiv.invalid.*cannot connect"):
        client.get("http://export.arxiv.invalid/api/query")
    assert time.monotonic() - start < 2.0


def test_a_read_timeout_is_retried(server, make_client):
    client = make_client(timeout_s=0.2)
    server.script(Reply(body="slow", delay_s=0.6), Reply(body="fine"))
    assert client.get(server.url("/x")).text == "fine"
    assert len(server.received) == 2


def test_404_is_returned_without_retry(server, client):
    server.script(Reply(status=404, body="gone"), Reply(body="unused"))
    response = client.get(server.url("/x"))
    assert response.status_code == 404
    assert len(server.received) == 1


def test_other_errors_are_raised_without_retry(server, client):
    server.script(Reply(status=400, body="bad   query\n"), Reply(body="unused"))
    url = server.url("/x")
    with pytest.raises(HttpStatusError) as caught:
        client.get(url)
    assert str(caught.value) == f"{url}: HTTP 400 Bad Request: bad query"
    assert caught.value.response.status_code == 400
    assert len(server.received) == 1


def test_context_manager_closes_the_client(server):
    server.script(Reply())
    with PoliteClient(PoliteHttpConfig(min_interval_s=0.0)) as client:
        client.get(server.url("/x"))
    with pytest.raises(RuntimeError):
        client.get(server.url("/x"))


def test_retry_after_parsing():
    now = datetime(2026, 3, 12, 10, 0, 0, tzinfo=UTC)
    assert retry_after_seconds("120", now) == 120.0
    assert retry_after_seconds(" 7 ", now) == 7.0
    assert retry_after_seconds("Thu, 12 Mar 2026 10:00:30 GMT", now) == 30.0
    assert retry_after_seconds("Thu, 12 Mar 2026 09:00:00 GMT", now) == 0.0
    assert retry_after_seconds("soon", now) is None
    assert retry_after_seconds("", now) is None
    assert retry_after_seconds(None, now) is None


def test_scripted_server_logs_what_it_answers(server: ScriptedServer):
    # Guards the harness: an unscripted request gets a 500, which the client retries.
    with PoliteClient(PoliteHttpConfig(min_interval_s=0.0, max_retries=0)) as client:
        with pytest.raises(SourceError, match="HTTP 500 after 1 attempts"):
            client.get(server.url("/nothing"))
    assert [request.path for request in server.received] == ["/nothing"]
