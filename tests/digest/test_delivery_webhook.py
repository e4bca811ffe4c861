"""Webhook delivery against a real HTTP server on loopback: one Slack-compatible JSON POST per
digest version, "for you" papers first with their summaries and markup escaped; a failing
endpoint keeps the night stored and is retried by the next run; the URL (a secret) is never
stored or printed. Also: feed entries carry each paper's summary."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.etree import ElementTree

from typer.testing import CliRunner

from digest.delivery import delivery_config
from digest.latex_text import latex_to_text
from digest.pipeline import run_digest
from digest.profile import ReaderProfile
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from nightshift.cli import app
from tests.digest.fault_server import FaultServer, summary_for
from tests.digest.test_pipeline import DAY, TITLES, options

SECRET_PATH = "/services/T000/B000/very-secret-token"


class Hook(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HookHandler)
        self.status = 200
        self.failures = 0  # the next POSTs answered 500 whatever the status
        self.posts: list[tuple[str, str, dict]] = []  # (path, content type, JSON body)
        self.times: list[float] = []  # time.monotonic() of each POST
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{SECRET_PATH}"

    def __enter__(self) -> Hook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _HookHandler(BaseHTTPRequestHandler):
    server: Hook

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = self.server.status
        if self.server.failures > 0:
            self.server.failures -= 1
            status = 500
        self.server.posts.append((self.path, self.headers["Content-Type"], body))
        self.server.times.append(time.monotonic())
        reply = b"ok" if status == 200 else b"invalid_token"
        self.send_response(status)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_webhook_gets_one_post_per_digest_version_and_retries_after_failure(tmp_path, db_url):
    profile = ReaderProfile(keywords=["benchmark"])
    with Hook() as hook, FaultServer() as stub:
        config = delivery_config([], hook.url, "https://digest.example.org")
        run = options(tmp_path, db_url, stub.base_url, delivery=config, profile=profile)
        hook.status = 500
        failed = run_digest(run)
        assert (failed.status, failed.exit_code, failed.delivery_failed) == ("succeeded", 1, True)
        assert "HTTP 500: invalid_token" in failed.deliveries[0]
        hook.status = 200
        retried = run_digest(run)  # what systemd's retry of exit 1 does
        assert retried.exit_code == 0 and retried.deliveries[0].endswith(": sent")
        again = run_digest(run)
        assert again.deliveries[0].endswith("skipped: already sent")
    assert len(hook.posts) == 2
    path, content_type, body = hook.posts[1]
    assert path == SECRET_PATH and content_type == "application/json"
    text = body["text"]
    assert text.startswith(f"*Paper digest {DAY}: 4 papers, 1 for you*")
    assert f"<https://digest.example.org/digest-{DAY}.html|read on the web>" in text
    # "For you" first, with why; every paper with its summary; a title's markup escaped.
    first = text.split("\n\n")[1]
    assert "A Benchmark for Paper Reviewing Agents" in first
    assert "_For you: mentions “benchmark”_" in first
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<script>" not in text
    for title in TITLES[1:]:
        assert latex_to_text(summary_for(title)) in text
    assert "Scaling Laws for α-Divergence Training" in text
    # The secret URL is neither stored nor printed: the store names the host and a hash.
    store = DigestStore(open_database(db_url))
    targets = {row.target for row in store.deliveries(DAY)}
    assert len(targets) == 1 and targets.pop().startswith("127.0.0.1 #")
    assert all(SECRET_PATH not in line for line in failed.deliveries + retried.deliveries)


def test_a_bad_webhook_url_is_one_line_and_exit_2(tmp_path, sqlite_url, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_DIGEST_WEBHOOK_URL", "ftp://example.org/hook")
    result = CliRunner().invoke(app, ["digest", "deliver", "--db", sqlite_url])
    assert result.exit_code == 2
    assert "the webhook URL must be http:// or https:// with a host" in result.output
    monkeypatch.delenv("NIGHTSHIFT_DIGEST_WEBHOOK_URL")
    nothing = CliRunner().invoke(app, ["digest", "deliver", "--db", sqlite_url])
    assert nothing.exit_code == 2 and "nothing to deliver to" in nothing.output
    no_store = CliRunner().invoke(
        app, ["digest", "deliver", "--db", sqlite_url, "--webhook-url", "http://127.0.0.1:9/x"]
    )
    assert no_store.exit_code == 2 and "no database file at" in no_store.output
    assert not (tmp_path / "digest.db").exists()


def test_feed_entries_carry_the_summaries_for_you_first(tmp_path, sqlite_url):
    with FaultServer() as stub:
        run_digest(
            options(
                tmp_path,
                sqlite_url,
                stub.base_url,
                profile=ReaderProfile(keywords=["tokenizer-free"]),
            )
        )
    feed = ElementTree.parse(tmp_path / "out" / "feed.xml").getroot()
    atom = "{http://www.w3.org/2005/Atom}"
    (entry,) = feed.findall(f"{atom}entry")
    summary = entry.find(f"{atom}summary")
    assert summary is not None and summary.get("type") == "html"
    html = summary.text or ""
    # The HTML is carried as text: the title's <script> is escaped inside it.
    assert "&lt;script&gt;" in html and "<script>" not in html
    items = html.split("<li>")[1:]
    assert "Tokenizer-Free Language Models" in items[0]
    assert "<em>For you: mentions “tokenizer-free”</em>" in items[0]
    for title in TITLES[1:]:  # LaTeX shown as text, as on the page
        assert f"<p>{latex_to_text(summary_for(title))}</p>" in html


def test_an_unreachable_webhook_fails_without_naming_its_secret(tmp_path, sqlite_url):
    url = f"http://127.0.0.1:9{SECRET_PATH}"  # port 9 (discard): nothing listens
    with FaultServer() as stub:
        config = delivery_config([], url, None)
        report = run_digest(options(tmp_path, sqlite_url, stub.base_url, delivery=config))
    assert report.exit_code == 1 and report.status == "succeeded"
    (line,) = report.deliveries
    assert line.startswith("delivery by webhook to 127.0.0.1 #") and ": failed: " in line
    assert "ConnectError" in line and SECRET_PATH not in line
    (row,) = DigestStore(open_database(sqlite_url)).deliveries(DAY)
    assert row.status == "failed" and SECRET_PATH not in (row.error or "") + row.target
