"""Webhook delivery: one JSON POST (Slack-compatible, `message.slack_payload`) to a URL.

The URL of a Slack or Mattermost incoming webhook is itself the secret, so it comes from the
environment (NIGHTSHIFT_DIGEST_WEBHOOK_URL) or the command line, and is never logged or stored:
the store records the host and a hash (`target_name`)."""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit

import httpx

from digest.clean_text import xml_safe
from digest.delivery.smtp_email import DeliveryConfigError, DeliveryError


def check_webhook_url(url: str) -> str:
    """The URL, or DeliveryConfigError: what httpx could not send to fails at start, not after
    the night (a malformed IPv6 host raised ValueError, a port past 65535 reached the send)."""
    url = url.strip()
    problem = "must be http:// or https:// with a host"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when not a number in 0-65535
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL):
        parts, port, problem = None, None, "is malformed (its host or port)"
    if parts is not None and (port == 0 or any(c.isspace() or ord(c) < 32 for c in url)):
        problem = "is malformed (its host or port)"
    elif parts is not None and parts.scheme in ("http", "https") and parts.hostname:
        return url
    # The URL is a secret: the message does not quote it.
    raise DeliveryConfigError(
        f"the webhook URL {problem} (--webhook-url or NIGHTSHIFT_DIGEST_WEBHOOK_URL)"
    )


def target_name(url: str) -> str:
    """How logs and the store name the webhook without its secret path."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return f"{urlsplit(url).hostname} #{digest}"


def post_webhook(url: str, payload: dict, timeout_s: float = 30.0) -> None:
    """One POST; a non-2xx answer or a network error is a DeliveryError."""
    where = f"webhook {target_name(url)}"
    try:
        response = httpx.post(url, json=payload, timeout=timeout_s)
    except httpx.HTTPError as exc:
        # Some errors quote the URL; the secret must not reach the log or the store.
        said = str(exc).replace(url, target_name(url))
        raise DeliveryError(f"{where}: {type(exc).__name__}: {said}") from None
    status = response.status_code
    if response.is_redirect:
        # Not followed: a POST redirected is resent by some clients as a GET, and the digest
        # would go to a host nobody configured.
        to = urlsplit(response.headers.get("location", "")).hostname or "elsewhere"
        raise DeliveryError(
            f"{where}: HTTP {status}, a redirect to {to} (not followed): give the final URL"
        )
    if not 200 <= status < 300:
        raise DeliveryError(f"{where}: HTTP {status}: {_said(response.text, url)}")


def _said(body: str, url: str) -> str:
    """The start of an error body for the log and the store: on one line, without control
    characters (a NUL fails a PostgreSQL text column), and without the URL's secret path,
    which a 404 page often quotes ("Cannot POST /services/T000/B000/XXXX")."""
    parts = urlsplit(url)
    for secret in (url, parts.path + (f"?{parts.query}" if parts.query else ""), parts.path):
        if len(secret) > 1:
            body = body.replace(secret, "[the URL]")
    text = " ".join(xml_safe(body).split())
    return text[:200]
