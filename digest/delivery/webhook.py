"""Webhook delivery: one JSON POST (Slack-compatible, `message.slack_payload`) to a URL.

The URL of a Slack or Mattermost incoming webhook is itself the secret, so it comes from the
environment (NIGHTSHIFT_DIGEST_WEBHOOK_URL) or the command line, and is never logged or stored:
the store records the host and a hash (`target_name`)."""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit

import httpx

from digest.delivery.smtp_email import DeliveryConfigError, DeliveryError


def check_webhook_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DeliveryConfigError(
            "the webhook URL must be http:// or https:// with a host "
            "(--webhook-url or NIGHTSHIFT_DIGEST_WEBHOOK_URL)"
        )
    return url.strip()


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
    if not 200 <= response.status_code < 300:
        raise DeliveryError(f"{where}: HTTP {response.status_code}: {response.text[:200]}")
