"""Email delivery tried from outside (issue 19) against a real STARTTLS SMTP server on loopback:
a recipient list the server takes only in part, the same reader named twice, a list longer than
the store's target column, malformed addresses and a sender with a display name. Nothing may
reach a reader twice, and a bad address is one line and exit 2, never a traceback."""

from __future__ import annotations

from email import message_from_bytes, policy

import pytest
from typer.testing import CliRunner

from digest.delivery import deliver, delivery_config
from nightshift.cli import app
from tests.digest.test_delivery_email import Mailbox, _server
from tests.digest.test_pipeline import DAY, write_papers


class PickyMailbox(Mailbox):
    """Refuses every recipient whose address starts with "nobody" (550), as a relay refuses
    an unknown local user, and takes the others."""

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # noqa: N802
        if address.startswith("nobody"):
            return "550 5.1.1 no such user"
        envelope.rcpt_tos.append(address)
        return "250 OK"


@pytest.fixture
def picky_server(tmp_path, monkeypatch):
    """A STARTTLS, AUTH-required server that refuses "nobody..." (test_delivery_email's), its
    settings in the environment; yields the mailbox."""
    server = _server(tmp_path, {}, "tls_context", PickyMailbox(), require_starttls=True)
    mailbox, env = next(server)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NIGHTSHIFT_SMTP_FROM", raising=False)
    monkeypatch.delenv("NIGHTSHIFT_SMTP_TLS", raising=False)
    yield mailbox
    server.close()  # stops the controller (the generator's finally)


def test_a_partly_refused_list_is_not_mailed_twice(picky_server, stored, sqlite_url):
    """The server took the message for one reader and refused the other: that reader has it,
    so neither a rerun nor `digest deliver` (nor the scheduler's retry) may send it again."""
    store, digest = stored
    config = delivery_config(["reader@example.org", "nobody@example.org"], None, None)
    (first,) = deliver(store, digest, config)
    assert first.status == "sent", first.line()
    assert "refused nobody@example.org (550 5.1.1 no such user)" in first.note
    assert "digest deliver --date" in first.note
    (again,) = deliver(store, digest, config)
    assert again.status == "skipped" and again.note == "already sent"
    retry = CliRunner().invoke(
        app,
        ["digest", "deliver", "--date", str(DAY), "--db", sqlite_url,
         "--email-to", "reader@example.org,nobody@example.org"],
    )  # fmt: skip
    assert retry.exit_code == 0 and "skipped: already sent" in retry.output, retry.output
    assert [recipients for recipients, _, _ in picky_server.messages] == [["reader@example.org"]]


def test_every_recipient_refused_is_a_failure_that_names_them(picky_server, stored):
    store, digest = stored
    config = delivery_config(["nobody@example.org", "nobody2@example.org"], None, None)
    (outcome,) = deliver(store, digest, config)
    assert outcome.status == "failed"
    assert "refused every recipient: nobody2@example.org (550 5.1.1 no such user), " in (
        outcome.note
    )
    assert picky_server.messages == []


def test_a_reader_named_twice_gets_one_copy(picky_server, stored):
    store, digest = stored
    config = delivery_config(["reader@example.org", " reader@example.org"], None, None)
    assert config.email_to == ["reader@example.org"]
    (outcome,) = deliver(store, digest, config)
    assert outcome.status == "sent"
    assert [recipients for recipients, _, _ in picky_server.messages] == [["reader@example.org"]]


def test_a_long_recipient_list_is_sent_once(picky_server, stored):
    """30 readers make a target name past the deliveries table's 500 characters: it was
    stored cut, never matched again, and each rerun mailed all 30 once more."""
    store, digest = stored
    readers = [f"reader{n:03d}@example.org" for n in range(30)]
    config = delivery_config(readers, None, None)
    assert deliver(store, digest, config)[0].status == "sent"
    (again,) = deliver(store, digest, config)
    assert again.status == "skipped", again.line()
    assert len(picky_server.messages) == 1 and len(picky_server.messages[0][0]) == 30
    assert len(again.target) <= 500 and "reader000@example.org" in again.target


def test_a_sender_with_a_display_name(picky_server, stored, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_SMTP_FROM", "Paper digest <digest@example.org>")
    store, digest = stored
    (outcome,) = deliver(store, digest, delivery_config(["reader@example.org"], None, None))
    assert outcome.status == "sent", outcome.line()
    ((_, raw, _),) = picky_server.messages
    message = message_from_bytes(raw, policy=policy.default)
    assert message["From"].addresses[0].addr_spec == "digest@example.org"
    assert message["Message-ID"].endswith("@example.org>")
    assert not message["Message-ID"].endswith(">>")


@pytest.mark.parametrize(
    "address", ["reader@", "@example.org", "a@b@example.org", "Reader <r@example.org>",
                "r@example..org", "r@example.org;x@example.org"],
)  # fmt: skip
def test_a_malformed_address_is_one_line_and_exit_2(tmp_path, sqlite_url, monkeypatch, address):
    """`reader@` passed the check and raised IndexError from the email package when the
    message was built, after the night's work."""
    monkeypatch.setenv("NIGHTSHIFT_SMTP_HOST", "127.0.0.1")
    monkeypatch.setenv("NIGHTSHIFT_SMTP_FROM", "digest@example.org")
    for command in (
        ["digest", "deliver", "--db", sqlite_url],
        ["digest", "run", "--source", str(write_papers(tmp_path / "p.jsonl")), "--db",
         sqlite_url, "--out", str(tmp_path / "out"), "--endpoint", "http://127.0.0.1:9/v1",
         "--model", "m"],
    ):  # fmt: skip
        result = CliRunner().invoke(app, [*command, "--email-to", address])
        assert result.exit_code == 2, result.output
        assert "--email-to: not an email address" in result.output
        assert result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("sender", ["digest@", "digest@example.org\nBcc: x@example.org"])
def test_a_malformed_sender_is_one_line_and_exit_2(sqlite_url, monkeypatch, sender):
    monkeypatch.setenv("NIGHTSHIFT_SMTP_HOST", "127.0.0.1")
    monkeypatch.setenv("NIGHTSHIFT_SMTP_FROM", sender)
    result = CliRunner().invoke(
        app, ["digest", "deliver", "--db", sqlite_url, "--email-to", "r@example.org"]
    )
    assert result.exit_code == 2 and "NIGHTSHIFT_SMTP_FROM must be an email address" in (
        result.output
    ), result.output
