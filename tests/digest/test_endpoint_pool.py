"""Several endpoints used as one (`--endpoint URL1,URL2`): the router's prefix policy in the
digest's process keeps a paper's summary and review on one server (its prefix cache holds the
paper for the review) and spreads the papers; a server that fails sits out, and the retry goes
to another, so a dead server costs the night nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from digest.endpoint import EndpointError, check_endpoint, endpoints_label
from digest.endpoint_pool import EndpointPool
from digest.paper import Paper
from digest.pipeline import run_digest
from digest.prompts import paper_block, review_messages, summary_messages
from digest.store.database import open_database
from digest.store.schema import ModelCallRow
from tests.digest.fault_server import FaultServer
from tests.digest.test_pipeline import TITLES, options


def _paper(i: int) -> Paper:
    abstract = f"We study problem {i} with a new method and report gains on benchmark {i}. " * 8
    return Paper(f"2603.{i:05d}", f"Paper {i}", abstract, ["A. Author"], ["cs.CL"])


def test_a_papers_calls_share_an_endpoint_and_papers_spread():
    pool = EndpointPool(["http://a/v1", "http://b/v1"])
    homes = []
    for i in range(6):
        block = paper_block(_paper(i), "abstract", _paper(i).abstract)
        summary = pool.acquire(summary_messages(block))
        review = pool.acquire(review_messages(block, "abstract"))  # the summary still in flight
        assert review is summary
        pool.release(summary)
        pool.release(review)
        homes.append(summary.url)
    assert homes.count("http://a/v1") == 3  # one each in turn


def test_a_failed_endpoint_sits_out_and_all_are_tried_when_all_failed():
    pool = EndpointPool(["http://a/v1", "http://b/v1"], cooldown_s=60)
    messages = [{"role": "user", "content": "x" * 500}]
    first = pool.acquire(messages)
    pool.release(first)
    pool.failed(first, "ConnectError")
    second = pool.acquire(messages)
    assert second is not first  # even though `first` holds the prefix
    pool.release(second)
    pool.failed(second, "ConnectError")
    assert pool.acquire(messages) in pool.endpoints  # none left: try anyway


def test_endpoint_options():
    model, label = check_endpoint("http://a:1/v1/, http://b:2/v1", "m", None)
    assert (model, label) == ("m", "http://a:1/v1,http://b:2/v1")
    for bad, message in [
        ("local,http://a:1/v1", "cannot be combined"),
        ("http://a:1/v1,http://a:1/v1", "twice"),
        ("http://a:1/v1,ftp://b", "http"),
        (",", "no URL"),
    ]:
        with pytest.raises(EndpointError, match=message):
            check_endpoint(bad, "m", None)
    many = [f"http://host-{i}.example:8000/v1" for i in range(40)]
    assert len(endpoints_label(many)) <= 500 and "and 39 more" in endpoints_label(many)


def _calls(db_url: str) -> list[ModelCallRow]:
    with open_database(db_url).connect() as conn:
        return list(conn.execute(select(ModelCallRow)))


def test_a_night_over_two_servers_keeps_each_paper_on_one(tmp_path, sqlite_url):
    with FaultServer() as a, FaultServer() as b:
        run = options(tmp_path, sqlite_url, f"{a.base_url},{b.base_url}")
        report = run_digest(run)
        assert (report.status, report.papers_done, report.calls) == ("succeeded", 4, 8)
        assert a.requests and b.requests and len(a.requests) + len(b.requests) == 8
    where: dict[str, set[str]] = {}
    for call in _calls(sqlite_url):
        where.setdefault(call.paper_id, set()).add(call.endpoint)
    assert len(where) == len(TITLES)
    assert all(len(endpoints) == 1 for endpoints in where.values()), where
    assert {e for endpoints in where.values() for e in endpoints} == {a.base_url, b.base_url}


def test_a_dead_server_costs_the_night_nothing(tmp_path, sqlite_url):
    with FaultServer() as alive:
        dead = "http://127.0.0.1:9/v1"  # nothing listens on the discard port
        report = run_digest(options(tmp_path, sqlite_url, f"{dead},{alive.base_url}"))
        assert (report.status, report.papers_done) == ("succeeded", 4)
        assert len(alive.requests) == 8
    assert {c.endpoint for c in _calls(sqlite_url)} == {alive.base_url}
