"""The digest against our real engine: `--endpoint local` starts `nightshift serve` (a tiny
random model with the default tokenizer) on loopback, the calls go through it, and it stops."""

from __future__ import annotations

from digest.pipeline import run_digest
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from nightshift.digest_commands import LOCAL_SPECULATION
from tests.digest.test_pipeline import DAY, options
from tests.engine.server.live_server import build_chat_model


def test_local_endpoint_runs_our_server(tmp_path, sqlite_url):
    model = build_chat_model(tmp_path / "tiny", max_position_embeddings=2048)
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
    # A random model writes no valid review JSON: the reply is kept raw, never dropped.
    digest = store.load_digest(DAY)
    assert all(e.review_raw for e in digest.entries)


def test_local_speculation_is_on_unless_turned_off():
    from nightshift.digest_commands import _run_options

    common = dict(
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
    assert _run_options(DAY, **common).local_server_args == ("--speculative", "ngram")
    assert _run_options(DAY, **common, local_speculation=False).local_server_args == ()
