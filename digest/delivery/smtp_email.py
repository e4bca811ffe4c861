"""Email delivery over SMTP with TLS and authentication, configured from the environment.

Two ways to TLS, NIGHTSHIFT_SMTP_TLS: "starttls" (port 587, submission) upgrades the connection
with STARTTLS before AUTH and before any message is sent, and a server that does not offer it is
refused rather than sent the password and the digest in clear; "implicit" (port 465,
submissions, RFC 8314) speaks TLS from the first byte, so a server that does not is a failed
handshake, never a fallback to clear. Either way the server's certificate is verified (the
system's CAs, or NIGHTSHIFT_SMTP_CA_FILE for a relay with a private CA)."""

from __future__ import annotations

import os
import smtplib
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import parseaddr
from pathlib import Path
from typing import Literal, get_args

SmtpTls = Literal["starttls", "implicit"]
# The port each way to TLS is served on: submission (RFC 6409), where STARTTLS is the rule, and
# submissions (RFC 8314), TLS from the connection's start.
DEFAULT_PORTS: dict[SmtpTls, int] = {"starttls": 587, "implicit": 465}


class DeliveryConfigError(ValueError):
    """Delivery settings that cannot work; the message names the variable or option."""


class DeliveryError(RuntimeError):
    """A delivery that failed; the digest is stored and can be sent again."""


@dataclass(slots=True, frozen=True)
class SmtpSettings:
    host: str
    port: int
    sender: str
    username: str | None = None
    password: str | None = None
    ca_file: Path | None = None
    timeout_s: float = 60.0
    tls: SmtpTls = "starttls"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SmtpSettings:
        """NIGHTSHIFT_SMTP_HOST (required), _TLS (starttls or implicit; default implicit when
        the port is 465, else starttls), _PORT (587, or 465 for implicit), _USER and _PASSWORD
        (both or neither), _FROM (default: the user), _CA_FILE (optional)."""
        env = os.environ if env is None else env
        host = env.get("NIGHTSHIFT_SMTP_HOST", "").strip()
        if not host:
            raise DeliveryConfigError("email delivery needs NIGHTSHIFT_SMTP_HOST (the SMTP server)")
        raw_port = (env.get("NIGHTSHIFT_SMTP_PORT") or "").strip()
        if raw_port and (not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535):
            raise DeliveryConfigError(f"NIGHTSHIFT_SMTP_PORT must be 1-65535, not {raw_port!r}")
        tls = _tls_mode(env.get("NIGHTSHIFT_SMTP_TLS"), int(raw_port) if raw_port else None)
        port = int(raw_port) if raw_port else DEFAULT_PORTS[tls]
        user = env.get("NIGHTSHIFT_SMTP_USER") or None
        password = env.get("NIGHTSHIFT_SMTP_PASSWORD") or None
        if (user is None) != (password is None):
            missing = "NIGHTSHIFT_SMTP_PASSWORD" if password is None else "NIGHTSHIFT_SMTP_USER"
            raise DeliveryConfigError(f"SMTP authentication needs {missing} as well")
        sender = (env.get("NIGHTSHIFT_SMTP_FROM") or user or "").strip()
        # "Paper digest <digest@example.org>" is a sender too: the address is checked.
        _, address = parseaddr(sender)
        if _address_problem(address) or "\n" in sender or "\r" in sender:
            raise DeliveryConfigError(
                "NIGHTSHIFT_SMTP_FROM must be an email address (the sender; default: "
                f"NIGHTSHIFT_SMTP_USER), not {sender!r}"
            )
        ca = env.get("NIGHTSHIFT_SMTP_CA_FILE") or None
        if ca is not None and not Path(ca).is_file():
            raise DeliveryConfigError(f"NIGHTSHIFT_SMTP_CA_FILE: no file {ca!r}")
        return cls(host, port, sender, user, password, Path(ca) if ca else None, tls=tls)


def _tls_mode(raw: str | None, port: int | None) -> SmtpTls:
    """The way to TLS asked for; unset, the one port 465 implies (nothing else is served
    there), else STARTTLS."""
    value = (raw or "").strip().lower()
    if not value:
        return "implicit" if port == DEFAULT_PORTS["implicit"] else "starttls"
    if value not in get_args(SmtpTls):
        raise DeliveryConfigError(
            f"NIGHTSHIFT_SMTP_TLS must be starttls (port 587) or implicit (port 465), not {raw!r}"
        )
    return value  # type: ignore[return-value]


def check_recipients(recipients: list[str]) -> list[str]:
    """The addresses, each once (a reader named twice gets one copy); a malformed one is a
    DeliveryConfigError at start, not an exception when the message is built after the night."""
    cleaned = list(dict.fromkeys(r.strip() for r in recipients if r.strip()))
    for recipient in cleaned:
        if problem := _address_problem(recipient):
            raise DeliveryConfigError(
                f"--email-to: not an email address: {recipient!r} ({problem})"
            )
    if not cleaned:
        raise DeliveryConfigError("--email-to names no address")
    return cleaned


def _address_problem(address: str) -> str | None:
    """Why `address` is no plain `local@domain` (None: it is): what the message headers and
    the SMTP envelope could not carry."""
    if any(c.isspace() or c in _NOT_IN_ADDRESS or ord(c) < 32 for c in address):
        return "spaces, commas, brackets or quotes"
    local, at, domain = address.rpartition("@")
    if not at or "@" in local:
        return "it needs exactly one @"
    if not local or not domain:
        return "a name before the @ and a domain after it"
    if any(not part for part in (*local.split("."), *domain.split("."))):
        return "an empty part between dots"
    return None


_NOT_IN_ADDRESS = frozenset('<>()[],;:"\\')


class PartlyRefused(DeliveryError):
    """The server took the message for some recipients and refused the others: the message
    went out, so the target counts as served (a retry would mail the others twice)."""

    def __init__(self, where: str, refused: dict[str, tuple[int, bytes | str]]) -> None:
        self.refused = refused
        super().__init__(f"{where}: the server refused {_refused(refused)}")


def send_email(settings: SmtpSettings, message: EmailMessage, recipients: list[str]) -> None:
    """Send over TLS, implicit or by STARTTLS (with AUTH when a user is set); DeliveryError
    says what failed."""
    where = f"SMTP {settings.host}:{settings.port}"
    if settings.tls == "implicit":
        where += " (implicit TLS)"
    context = ssl.create_default_context(cafile=str(settings.ca_file) if settings.ca_file else None)
    try:
        with _connect(settings, context, where) as smtp:
            if settings.username is not None:
                smtp.login(settings.username, settings.password or "")
            refused = smtp.send_message(message, settings.sender, recipients)
    except DeliveryError:
        raise
    except smtplib.SMTPRecipientsRefused as exc:
        raise DeliveryError(
            f"{where}: the server refused every recipient: {_refused(exc.recipients)}"
        ) from None
    except smtplib.SMTPAuthenticationError as exc:
        raise DeliveryError(f"{where}: authentication failed ({_reply(exc)})") from None
    except smtplib.SMTPException as exc:
        hint = _hint(settings, exc)
        raise DeliveryError(f"{where}: {type(exc).__name__}: {_reply(exc)}{hint}") from None
    except ssl.SSLError as exc:
        hint = _hint(settings, exc)
        raise DeliveryError(f"{where}: TLS failed ({exc.reason or exc}){hint}") from None
    except OSError as exc:
        hint = _hint(settings, exc)
        raise DeliveryError(f"{where}: cannot connect ({exc.strerror or exc}){hint}") from None
    if refused:
        raise PartlyRefused(where, refused)


def _connect(settings: SmtpSettings, context: ssl.SSLContext, where: str) -> smtplib.SMTP:
    """A connection that is TLS before anything secret is said: TLS from the start, or
    upgraded by STARTTLS (refused where the server does not offer it)."""
    host, port, timeout = settings.host, settings.port, settings.timeout_s
    if settings.tls == "implicit":
        smtp = smtplib.SMTP_SSL(host, port, timeout=timeout, context=context)
    else:
        smtp = smtplib.SMTP(host, port, timeout=timeout)
    try:
        smtp.ehlo()
        if settings.tls == "starttls":
            if not smtp.has_extn("starttls"):
                raise DeliveryError(f"{where} does not offer STARTTLS; refusing to send in clear")
            smtp.starttls(context=context)
            smtp.ehlo()
    except BaseException:
        smtp.close()
        raise
    return smtp


def _hint(settings: SmtpSettings, exc: Exception) -> str:
    """The likely cause of the two ways a TLS mode that does not match the server's fails: a
    STARTTLS client waits for a greeting an implicit-TLS server never sends (it waits for the
    handshake), and an implicit-TLS handshake reads a plain "220" greeting as a bad record."""
    # smtplib reports the greeting's timeout as a disconnection "...: timed out".
    waited = isinstance(exc, TimeoutError) or (
        isinstance(exc, smtplib.SMTPServerDisconnected) and "timed out" in str(exc)
    )
    if settings.tls == "starttls" and waited:
        return (
            "; no greeting: a server that wants TLS from the start (usually port 465) needs "
            "NIGHTSHIFT_SMTP_TLS=implicit"
        )
    if settings.tls == "implicit" and isinstance(exc, ssl.SSLError):
        return (
            "; the server may speak plain SMTP first (usually port 587): "
            "NIGHTSHIFT_SMTP_TLS=starttls"
        )
    return ""


def _refused(refused: dict[str, tuple[int, bytes | str]]) -> str:
    """`bad@x.org (550 5.1.1 no such user), ...`, as smtplib reports refused recipients."""
    said = []
    for address, (code, message) in sorted(refused.items()):
        text = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
        said.append(f"{address} ({code} {' '.join(str(text).split())})")
    return ", ".join(said)


def _reply(exc: smtplib.SMTPException) -> str:
    error = getattr(exc, "smtp_error", None)
    code = getattr(exc, "smtp_code", None)
    if isinstance(error, bytes):
        error = error.decode("utf-8", "replace")
    return f"{code} {error}" if code else str(exc)
