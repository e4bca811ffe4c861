"""Email delivery against a real SMTP server on loopback (aiosmtpd) that requires STARTTLS, on a
certificate made here, and AUTH: the digest arrives once, with a text and an HTML part carrying
the summaries; a failed delivery keeps the night's results and pages and is retried by `digest
deliver`; a server without STARTTLS is refused before any password is sent; bad settings are
one line and exit 2."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
from email import message_from_bytes, policy
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from digest.delivery import delivery_config
from digest.delivery.smtp_email import SmtpSettings
from digest.latex_text import latex_to_text
from digest.pipeline import run_digest
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from nightshift.cli import app
from tests.digest.fault_server import FaultServer, summary_for
from tests.digest.test_pipeline import DAY, TITLES, options, write_papers

USER, PASSWORD = "digest@example.org", "s3cret-pass"


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (an IP subjectAltName, as ssl checks it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "smtp.pem", folder / "smtp.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class Mailbox:
    """The SMTP server's handler: what arrived, and whether it came over TLS."""

    def __init__(self) -> None:
        self.messages: list[tuple[list[str], bytes, bool]] = []
        self.logins: list[tuple[str, str]] = []

    async def handle_DATA(self, server, session, envelope) -> str:  # noqa: N802
        # After STARTTLS aiosmtpd sets session.ssl; with implicit TLS the socket itself is TLS.
        tls = session.ssl is not None or server.transport.get_extra_info("ssl_object") is not None
        self.messages.append((list(envelope.rcpt_tos), envelope.original_content, tls))
        return "250 OK"

    def authenticate(self, server, session, envelope, mechanism, auth_data) -> AuthResult:
        assert isinstance(auth_data, LoginPassword)
        login, password = auth_data.login.decode(), auth_data.password.decode()
        self.logins.append((login, password))
        return AuthResult(success=(login, password) == (USER, PASSWORD), handled=False)


# aiosmtpd's Controller waits this long for its thread's server to answer. Its default (5 s) is
# short on a loaded 2-core machine: one unexplained failure of this file was seen under load.
READY_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(
    tmp_path, env: dict[str, str], context_option: str, mailbox: Mailbox | None = None, **options
):
    """An AUTH-required SMTP server on 127.0.0.1 with a fresh certificate, given to aiosmtpd's
    Controller as `context_option` (tls_context: STARTTLS; ssl_context: TLS from the first
    byte), and further Controller `options`; yields (mailbox, env), the client's settings."""
    cert, key = _certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    mailbox = mailbox or Mailbox()
    port = _free_port()
    controller = Controller(
        mailbox,
        hostname="127.0.0.1",
        port=port,
        auth_required=True,
        authenticator=mailbox.authenticate,
        ready_timeout=READY_S,
        **{context_option: context},
        **options,
    )
    controller.start()
    env = {
        "NIGHTSHIFT_SMTP_HOST": "127.0.0.1",
        "NIGHTSHIFT_SMTP_PORT": str(port),
        **env,
        "NIGHTSHIFT_SMTP_USER": USER,
        "NIGHTSHIFT_SMTP_PASSWORD": PASSWORD,
        "NIGHTSHIFT_SMTP_CA_FILE": str(cert),
    }
    try:
        yield mailbox, env
    finally:
        controller.stop()


@pytest.fixture
def smtp_server(tmp_path):
    """A STARTTLS-only, AUTH-required SMTP server on 127.0.0.1; yields (mailbox, env)."""
    yield from _server(tmp_path, {}, "tls_context", require_starttls=True)


@pytest.fixture
def implicit_tls_server(tmp_path):
    """An SMTP server that speaks TLS from the first byte (port 465's way, RFC 8314) and
    requires AUTH, on 127.0.0.1; yields (mailbox, env)."""
    # aiosmtpd counts only STARTTLS as TLS; this socket is TLS throughout.
    yield from _server(
        tmp_path, {"NIGHTSHIFT_SMTP_TLS": "implicit"}, "ssl_context", auth_require_tls=False
    )


def _parts(raw: bytes) -> tuple[object, str, str]:
    message = message_from_bytes(raw, policy=policy.default)
    assert message.get_content_type() == "multipart/alternative"
    text = message.get_body(("plain",)).get_content()
    html = message.get_body(("html",)).get_content()
    return message, text, html


def test_a_run_mails_the_digest_once_over_starttls_with_auth(tmp_path, db_url, smtp_server,
                                                             monkeypatch):  # fmt: skip
    mailbox, env = smtp_server
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = delivery_config(["reader@example.org"], None, "https://digest.example.org/")
    with FaultServer() as stub:
        run = options(tmp_path, db_url, stub.base_url, delivery=config)
        report = run_digest(run)
        assert (report.status, report.exit_code, report.delivery_failed) == ("succeeded", 0, False)
        assert report.deliveries == ["delivery by email to reader@example.org: sent"]
        # A rerun that changes nothing does not mail the readers again.
        again = run_digest(run)
        assert again.deliveries == [
            "delivery by email to reader@example.org: skipped: already sent"
        ]
    assert mailbox.logins == [(USER, PASSWORD)]
    ((recipients, raw, tls),) = mailbox.messages
    assert recipients == ["reader@example.org"] and tls
    message, text, html = _parts(raw)
    assert message["Subject"] == f"Paper digest {DAY}: 4 papers"
    assert message["From"] == USER and message["To"] == "reader@example.org"
    page = f"https://digest.example.org/digest-{DAY}.html"
    assert page in text and f'href="{page}"' in html
    for title in TITLES:  # LaTeX as text ($\alpha$ is α), as the page shows it
        summary = latex_to_text(summary_for(title))
        assert latex_to_text(title) in text
        assert " ".join(summary.split()) in " ".join(text.split())
        # Autoescaped in HTML: the title's <script> arrives as text.
        assert summary.replace("<", "&lt;").replace(">", "&gt;") in html
    assert "α-Divergence" in text and "$" not in text
    assert "<script>" not in html


def test_a_failed_delivery_keeps_the_digest_and_digest_deliver_sends_it(
    tmp_path, sqlite_url, smtp_server, monkeypatch
):
    mailbox, env = smtp_server
    for name, value in {**env, "NIGHTSHIFT_SMTP_PASSWORD": "wrong"}.items():
        monkeypatch.setenv(name, value)
    runner = CliRunner()
    out = str(tmp_path / "out")
    source = str(write_papers(tmp_path / "papers.jsonl"))
    with FaultServer() as stub:
        result = runner.invoke(
            app,
            ["digest", "run", "--source", source, "--date", str(DAY), "--db", sqlite_url,
             "--out", out, "--endpoint", stub.base_url, "--model", "stub-model",
             "--email-to", "a@example.org,b@example.org"],
        )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "delivery by email to a@example.org, b@example.org: failed: SMTP 127.0.0.1" in (
        result.output
    )
    assert "authentication failed (535" in result.output
    assert f"send it again: digest deliver --date {DAY}" in result.output
    assert mailbox.messages == []
    # Everything the night made is stored and published.
    store = DigestStore(open_database(sqlite_url))
    assert [item.status for item, _ in store.items(DAY)] == ["done"] * 4
    assert (tmp_path / "out" / f"digest-{DAY}.html").is_file()
    (failed,) = store.deliveries(DAY)
    assert failed.status == "failed" and "authentication failed" in failed.error

    monkeypatch.setenv("NIGHTSHIFT_SMTP_PASSWORD", PASSWORD)
    deliver = ["digest", "deliver", "--date", str(DAY), "--db", sqlite_url]
    deliver += ["--email-to", "a@example.org,b@example.org"]
    sent = runner.invoke(app, deliver)
    assert sent.exit_code == 0, sent.output
    assert "delivery by email to a@example.org, b@example.org: sent" in sent.output
    ((recipients, _, tls),) = mailbox.messages
    assert recipients == ["a@example.org", "b@example.org"] and tls
    skipped = runner.invoke(app, deliver)
    assert "skipped: already sent" in skipped.output and len(mailbox.messages) == 1
    forced = runner.invoke(app, [*deliver, "--again"])
    assert forced.exit_code == 0 and len(mailbox.messages) == 2
    unknown = runner.invoke(app, [*deliver[:3], "2020-01-01", *deliver[4:]])
    assert unknown.exit_code == 2 and "no digest for 2020-01-01" in unknown.output  # a bad --date


def test_a_server_without_starttls_is_refused_before_the_password(tmp_path, sqlite_url,
                                                                  monkeypatch):  # fmt: skip
    mailbox = Mailbox()
    port = _free_port()
    controller = Controller(
        mailbox, hostname="127.0.0.1", port=port, ready_timeout=READY_S
    )  # no TLS
    controller.start()
    try:
        monkeypatch.setenv("NIGHTSHIFT_SMTP_HOST", "127.0.0.1")
        monkeypatch.setenv("NIGHTSHIFT_SMTP_PORT", str(port))
        monkeypatch.setenv("NIGHTSHIFT_SMTP_USER", USER)
        monkeypatch.setenv("NIGHTSHIFT_SMTP_PASSWORD", PASSWORD)
        config = delivery_config(["reader@example.org"], None, None)
        with FaultServer() as stub:
            report = run_digest(options(tmp_path, sqlite_url, stub.base_url, delivery=config))
    finally:
        controller.stop()
    assert report.delivery_failed and report.exit_code == 1 and report.status == "succeeded"
    assert "does not offer STARTTLS; refusing to send in clear" in report.deliveries[0]
    assert mailbox.messages == [] and mailbox.logins == []


# aiosmtpd warns on AUTH without STARTTLS; the implicit-TLS server's socket is TLS throughout.
_AUTH_OVER_IMPLICIT_TLS = pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring")


@_AUTH_OVER_IMPLICIT_TLS
def test_a_run_mails_the_digest_over_implicit_tls(tmp_path, sqlite_url, implicit_tls_server,
                                                 monkeypatch):  # fmt: skip
    """NIGHTSHIFT_SMTP_TLS=implicit: TLS from the first byte, the certificate checked, then AUTH
    and the message; once, and a rerun skips the sent target."""
    mailbox, env = implicit_tls_server
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = delivery_config(["reader@example.org"], None, None)
    assert config.smtp.tls == "implicit"
    with FaultServer() as stub:
        run = options(tmp_path, sqlite_url, stub.base_url, delivery=config)
        report = run_digest(run)
        assert report.deliveries == ["delivery by email to reader@example.org: sent"]
        assert run_digest(run).deliveries[0].endswith("skipped: already sent")
    assert mailbox.logins == [(USER, PASSWORD)]
    ((recipients, raw, tls),) = mailbox.messages
    assert recipients == ["reader@example.org"] and tls
    _, text, html = _parts(raw)
    assert latex_to_text(TITLES[1]) in text and "<html" in html


@_AUTH_OVER_IMPLICIT_TLS
def test_implicit_tls_never_falls_back_to_clear(tmp_path, sqlite_url, implicit_tls_server,
                                                monkeypatch):  # fmt: skip
    """Against a plain SMTP server, or one whose certificate the CA file does not vouch for,
    the handshake fails and nothing is said: no password, no message."""
    tls_mailbox, env = implicit_tls_server
    plain = Mailbox()
    port = _free_port()
    controller = Controller(plain, hostname="127.0.0.1", port=port, ready_timeout=READY_S)
    controller.start()
    (tmp_path / "other").mkdir()
    other_ca, _ = _certificate(tmp_path / "other")  # a CA that did not sign the server's
    try:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("NIGHTSHIFT_SMTP_PORT", str(port))
        to_plain = delivery_config(["reader@example.org"], None, None)
        monkeypatch.setenv("NIGHTSHIFT_SMTP_PORT", env["NIGHTSHIFT_SMTP_PORT"])
        monkeypatch.setenv("NIGHTSHIFT_SMTP_CA_FILE", str(other_ca))
        untrusted = delivery_config(["reader@example.org"], None, None)
        with FaultServer() as stub:
            first = run_digest(options(tmp_path, sqlite_url, stub.base_url, delivery=to_plain))
            second = run_digest(options(tmp_path, sqlite_url, stub.base_url, delivery=untrusted))
    finally:
        controller.stop()
    for report in (first, second):
        assert report.delivery_failed and report.exit_code == 1 and report.status == "succeeded"
        assert "(implicit TLS): TLS failed" in report.deliveries[0], report.deliveries
    assert "CERTIFICATE_VERIFY_FAILED" in second.deliveries[0]
    assert plain.messages == plain.logins == tls_mailbox.messages == tls_mailbox.logins == []


@pytest.mark.parametrize(
    ("port", "tls", "expected"),
    [
        (None, None, ("starttls", 587)),
        ("465", None, ("implicit", 465)),
        (None, "implicit", ("implicit", 465)),
        ("2525", "IMPLICIT", ("implicit", 2525)),
        ("465", "starttls", ("starttls", 465)),
    ],
)
def test_the_way_to_tls_and_its_port(port, tls, expected):
    env = {"NIGHTSHIFT_SMTP_HOST": "mail", "NIGHTSHIFT_SMTP_FROM": "d@x.org"}
    env |= {"NIGHTSHIFT_SMTP_PORT": port} if port else {}
    env |= {"NIGHTSHIFT_SMTP_TLS": tls} if tls else {}
    settings = SmtpSettings.from_env(env)
    assert (settings.tls, settings.port) == expected


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({}, "email delivery needs NIGHTSHIFT_SMTP_HOST"),
        ({"NIGHTSHIFT_SMTP_HOST": "mail", "NIGHTSHIFT_SMTP_PORT": "99999"},
         "NIGHTSHIFT_SMTP_PORT must be 1-65535, not '99999'"),
        ({"NIGHTSHIFT_SMTP_HOST": "mail", "NIGHTSHIFT_SMTP_USER": "u@x.org"},
         "SMTP authentication needs NIGHTSHIFT_SMTP_PASSWORD as well"),
        ({"NIGHTSHIFT_SMTP_HOST": "mail"}, "NIGHTSHIFT_SMTP_FROM must be an email address"),
        ({"NIGHTSHIFT_SMTP_HOST": "mail", "NIGHTSHIFT_SMTP_FROM": "d@x.org",
          "NIGHTSHIFT_SMTP_CA_FILE": "/nonexistent/ca.pem"}, "NIGHTSHIFT_SMTP_CA_FILE: no file"),
        ({"NIGHTSHIFT_SMTP_HOST": "mail", "NIGHTSHIFT_SMTP_FROM": "d@x.org",
          "NIGHTSHIFT_SMTP_TLS": "ssl"}, "NIGHTSHIFT_SMTP_TLS must be starttls (port 587) or "
         "implicit (port 465), not 'ssl'"),
    ],
)  # fmt: skip
def test_bad_smtp_settings_are_one_line_and_exit_2_before_any_work(
    tmp_path, sqlite_url, monkeypatch, env, problem
):
    for name in ("HOST", "PORT", "USER", "PASSWORD", "FROM", "CA_FILE", "TLS"):
        monkeypatch.delenv(f"NIGHTSHIFT_SMTP_{name}", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(
        app,
        ["digest", "run", "--source", str(write_papers(tmp_path / "p.jsonl")), "--db",
         sqlite_url, "--out", str(tmp_path / "out"), "--endpoint", "http://127.0.0.1:9/v1",
         "--model", "m", "--email-to", "reader@example.org"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert problem in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "digest.db").exists()  # refused before the database is opened
    bad_to = CliRunner().invoke(
        app, ["digest", "deliver", "--db", sqlite_url, "--email-to", "not-an-address"]
    )
    assert bad_to.exit_code == 2 and "--email-to: not an email address" in bad_to.output


@pytest.mark.parametrize(
    ("mode", "greeting", "hint"),
    [
        # An implicit-TLS server says nothing until the handshake: a STARTTLS client times out.
        ("starttls", b"", "NIGHTSHIFT_SMTP_TLS=implicit"),
        # A plain server greets in clear text: an implicit-TLS handshake reads a bad record.
        ("implicit", b"220 smtp.example.org ESMTP\r\n", "NIGHTSHIFT_SMTP_TLS=starttls"),
    ],
)
def test_a_tls_mode_the_server_does_not_speak_is_named(mode, greeting, hint):
    """Found from outside: STARTTLS against port 465 waited its whole timeout, then said only
    "cannot connect (timed out)"."""
    import threading
    from email.message import EmailMessage

    from digest.delivery.smtp_email import DeliveryError, send_email

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(greeting)
            conn.recv(1024)  # until the client gives up or sends its handshake

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    settings = SmtpSettings("127.0.0.1", port, "digest@example.org", timeout_s=1.0, tls=mode)
    with listener, pytest.raises(DeliveryError, match=hint):
        send_email(settings, EmailMessage(), ["reader@example.org"])
    thread.join(timeout=5)
