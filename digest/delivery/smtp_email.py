"""Email delivery over SMTP with STARTTLS and authentication, configured from the environment.

The connection is always upgraded with STARTTLS before AUTH and before any message is sent: a
server that does not offer it is refused rather than sent the password and the digest in clear.
The server's certificate is verified (the system's CAs, or NIGHTSHIFT_SMTP_CA_FILE for a relay
with a private CA)."""

from __future__ import annotations

import os
import smtplib
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path

DEFAULT_PORT = 587  # submission (RFC 6409), where STARTTLS is the rule


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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SmtpSettings:
        """NIGHTSHIFT_SMTP_HOST (required), _PORT (587), _USER and _PASSWORD (both or neither),
        _FROM (default: the user), _CA_FILE (optional)."""
        env = os.environ if env is None else env
        host = env.get("NIGHTSHIFT_SMTP_HOST", "").strip()
        if not host:
            raise DeliveryConfigError("email delivery needs NIGHTSHIFT_SMTP_HOST (the SMTP server)")
        raw_port = env.get("NIGHTSHIFT_SMTP_PORT", str(DEFAULT_PORT)).strip()
        if not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535:
            raise DeliveryConfigError(f"NIGHTSHIFT_SMTP_PORT must be 1-65535, not {raw_port!r}")
        user = env.get("NIGHTSHIFT_SMTP_USER") or None
        password = env.get("NIGHTSHIFT_SMTP_PASSWORD") or None
        if (user is None) != (password is None):
            missing = "NIGHTSHIFT_SMTP_PASSWORD" if password is None else "NIGHTSHIFT_SMTP_USER"
            raise DeliveryConfigError(f"SMTP authentication needs {missing} as well")
        sender = (env.get("NIGHTSHIFT_SMTP_FROM") or user or "").strip()
        if "@" not in sender:
            raise DeliveryConfigError(
                "NIGHTSHIFT_SMTP_FROM must be an email address (the sender; default: "
                f"NIGHTSHIFT_SMTP_USER), not {sender!r}"
            )
        ca = env.get("NIGHTSHIFT_SMTP_CA_FILE") or None
        if ca is not None and not Path(ca).is_file():
            raise DeliveryConfigError(f"NIGHTSHIFT_SMTP_CA_FILE: no file {ca!r}")
        return cls(host, int(raw_port), sender, user, password, Path(ca) if ca else None)


def check_recipients(recipients: list[str]) -> list[str]:
    cleaned = [r.strip() for r in recipients if r.strip()]
    bad = [r for r in cleaned if "@" not in r or any(c.isspace() for c in r)]
    if bad:
        raise DeliveryConfigError(f"--email-to: not an email address: {bad[0]!r}")
    if not cleaned:
        raise DeliveryConfigError("--email-to names no address")
    return cleaned


def send_email(settings: SmtpSettings, message: EmailMessage, recipients: list[str]) -> None:
    """Send over STARTTLS (with AUTH when a user is set); DeliveryError says what failed."""
    where = f"SMTP {settings.host}:{settings.port}"
    context = ssl.create_default_context(cafile=str(settings.ca_file) if settings.ca_file else None)
    try:
        with smtplib.SMTP(settings.host, settings.port, timeout=settings.timeout_s) as smtp:
            smtp.ehlo()
            if not smtp.has_extn("starttls"):
                raise DeliveryError(f"{where} does not offer STARTTLS; refusing to send in clear")
            smtp.starttls(context=context)
            smtp.ehlo()
            if settings.username is not None:
                smtp.login(settings.username, settings.password or "")
            refused = smtp.send_message(message, settings.sender, recipients)
    except DeliveryError:
        raise
    except smtplib.SMTPAuthenticationError as exc:
        raise DeliveryError(f"{where}: authentication failed ({_reply(exc)})") from None
    except smtplib.SMTPException as exc:
        raise DeliveryError(f"{where}: {type(exc).__name__}: {_reply(exc)}") from None
    except ssl.SSLError as exc:
        raise DeliveryError(f"{where}: TLS failed ({exc.reason or exc})") from None
    except OSError as exc:
        raise DeliveryError(f"{where}: cannot connect ({exc.strerror or exc})") from None
    if refused:
        names = ", ".join(sorted(refused))
        raise DeliveryError(f"{where}: the server refused some recipients: {names}")


def _reply(exc: smtplib.SMTPException) -> str:
    error = getattr(exc, "smtp_error", None)
    code = getattr(exc, "smtp_code", None)
    if isinstance(error, bytes):
        error = error.decode("utf-8", "replace")
    return f"{code} {error}" if code else str(exc)
