"""Webhook delivery tried from outside (issue 19): an endpoint whose error page quotes the
secret path (and carries control characters), a redirect, and URLs that cannot be sent to.
The URL never reaches the log or the store; a bad URL is one line and exit 2 at start."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from digest.delivery import deliver, delivery_config
from nightshift.cli import app
from tests.digest.test_pipeline import DAY

SECRET = "/services/T000/B000/very-secret-token"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts += 1
        if self.server.mode == "redirect":
            self.send_response(302)
            self.send_header("Location", "https://elsewhere.example.org/hook")
            body = b""
        else:  # an Express-style 404 that quotes the path, with a NUL and line breaks
            self.send_response(404)
            body = f"Cannot POST {self.path}\x00\r\n<pre>{self.path}</pre>".encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def hook():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.posts, server.mode = 0, "404"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}{SECRET}"
    yield server
    server.shutdown()
    server.server_close()


def test_an_error_page_quoting_the_secret_path_is_not_logged_or_stored(hook, stored, caplog):
    store, digest = stored
    (outcome,) = deliver(store, digest, delivery_config([], hook.url, None))
    assert outcome.status == "failed" and "HTTP 404: Cannot POST [the URL]" in outcome.note
    (row,) = store.deliveries(DAY)
    for text in (outcome.line(), row.error, row.target, caplog.text):
        assert "very-secret-token" not in text and "\x00" not in text and "\n" not in text.strip()


def test_a_redirect_is_not_followed_and_says_so(hook, stored):
    hook.mode = "redirect"
    store, digest = stored
    (outcome,) = deliver(store, digest, delivery_config([], hook.url, None))
    assert outcome.status == "failed" and hook.posts == 1
    assert "HTTP 302, a redirect to elsewhere.example.org (not followed)" in outcome.note


@pytest.mark.parametrize(
    "url",
    ["https://[::1/hook", "http://hooks.example.org:99999/x", "http://hooks.example.org:port/x",
     "https://hooks example.org/x"],
)  # fmt: skip
def test_a_url_that_cannot_be_sent_to_is_one_line_and_exit_2(sqlite_url, url):
    """`https://[::1/hook` raised ValueError from urlsplit: a traceback."""
    result = CliRunner().invoke(
        app, ["digest", "deliver", "--db", sqlite_url, "--webhook-url", url]
    )
    assert result.exit_code == 2, result.output
    assert "the webhook URL is malformed" in result.output
    assert result.output.count("\n") == 1 and "hooks" not in result.output
