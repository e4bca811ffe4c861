"""Sending a stored digest to its readers: by email (SMTP over TLS) and by webhook.

`deliver` runs at the end of `digest run` (and `digest schedule`'s nights), after the pages are
written, and by `digest deliver --date D`. Each target's attempt is recorded in the store with
the digest's fingerprint: a target that already received the digest as it is now is skipped (a
rerun does not mail twice), one that failed is tried again by the next run or `digest deliver`.
A failure never touches the stored results or the pages; it is reported and makes the command
exit 1. A digest with no reviewed paper (the endpoint was down all night) is not sent, as it is
not announced in the feed."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from functools import partial

from digest.delivery.message import email_message, slack_payload
from digest.delivery.smtp_email import (
    DeliveryConfigError,
    DeliveryError,
    PartlyRefused,
    SmtpSettings,
    check_recipients,
    send_email,
)
from digest.delivery.webhook import check_webhook_url, post_webhook, target_name
from digest.entries import DailyDigest
from digest.store.digest_store import DigestStore

__all__ = [
    "DeliveryConfig",
    "DeliveryConfigError",
    "DeliveryOutcome",
    "deliver",
    "delivery_config",
    "target_names",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DeliveryConfig:
    email_to: list[str] = field(default_factory=list)
    smtp: SmtpSettings | None = None  # set when email_to is
    webhook_url: str | None = None
    site_url: str | None = None  # links to the page, when the pages are published


@dataclass(slots=True)
class DeliveryOutcome:
    channel: str  # email | webhook
    target: str
    status: str  # sent | failed | skipped
    note: str = ""

    def line(self) -> str:
        note = f": {self.note}" if self.note else ""
        return f"delivery by {self.channel} to {self.target}: {self.status}{note}"


def delivery_config(
    email_to: list[str], webhook_url: str | None, site_url: str | None
) -> DeliveryConfig | None:
    """The checked delivery settings (None: deliver nothing); DeliveryConfigError names a bad
    address, URL or SMTP variable, so that the command refuses at start."""
    if not email_to and not webhook_url:
        return None
    recipients = check_recipients(email_to) if email_to else []
    return DeliveryConfig(
        email_to=recipients,
        smtp=SmtpSettings.from_env() if recipients else None,
        webhook_url=check_webhook_url(webhook_url) if webhook_url else None,
        site_url=site_url,
    )


def deliver(
    store: DigestStore,
    digest: DailyDigest,
    config: DeliveryConfig,
    again: bool = False,
    only: set[tuple[str, str]] | None = None,
) -> list[DeliveryOutcome]:
    """Send the digest to each configured target not yet served this version of it (`again`:
    to every target); `only`: just these (channel, target) of them (a retry's due ones)."""
    fingerprint = digest.fingerprint()
    outcomes = []
    for channel, target, send in _targets(digest, config):
        if only is not None and (channel, target) not in only:
            continue
        if not digest.done:
            outcomes.append(DeliveryOutcome(channel, target, "skipped", "no paper reviewed"))
            continue
        if not again and store.delivered(digest.digest_date, channel, target, fingerprint):
            outcomes.append(DeliveryOutcome(channel, target, "skipped", "already sent"))
            continue
        try:
            send()
        except PartlyRefused as exc:
            # The others have it: recorded as sent, so that no retry mails them twice.
            store.record_delivery(digest.digest_date, channel, target, fingerprint, None)
            day = digest.digest_date.isoformat()
            note = (
                f"{exc}; the others have it. Send it to the refused ones once their address is "
                f"fixed: nightshift digest deliver --date {day} --email-to ADDRESSES"
            )
            outcomes.append(DeliveryOutcome(channel, target, "sent", note))
            continue
        except DeliveryError as exc:
            store.record_delivery(digest.digest_date, channel, target, fingerprint, str(exc))
            outcomes.append(DeliveryOutcome(channel, target, "failed", str(exc)))
            continue
        store.record_delivery(digest.digest_date, channel, target, fingerprint, None)
        outcomes.append(DeliveryOutcome(channel, target, "sent"))
    for outcome in outcomes:
        problem = outcome.status == "failed" or (outcome.status == "sent" and outcome.note)
        (log.error if problem else log.info)("%s", outcome.line())
    return outcomes


def target_names(config: DeliveryConfig) -> list[tuple[str, str]]:
    """(channel, target) of each configured target, as the deliveries table names them."""
    names = []
    if config.email_to and config.smtp is not None:
        names.append(("email", recipients_name(config.email_to)))
    if config.webhook_url:
        names.append(("webhook", target_name(config.webhook_url)))
    return names


# The deliveries table's target column holds 500 characters; a longer name was stored cut,
# never matched the full one again, and every rerun mailed the whole list once more.
TARGET_CHARS = 500


def recipients_name(recipients: list[str]) -> str:
    """The email target's name: the addresses, or for a list too long to store, the first of
    them, the count of the rest and a hash of the whole list (a changed list is a new target)."""
    name = ", ".join(recipients)
    if len(name) <= TARGET_CHARS:
        return name
    tag = hashlib.sha256(name.encode()).hexdigest()[:12]
    shown: list[str] = []
    for address in recipients:
        candidate = ", ".join([*shown, address])
        if len(candidate) > TARGET_CHARS - 60:
            break
        shown.append(address)
    return f"{', '.join(shown)} and {len(recipients) - len(shown)} more #{tag}"


def _targets(digest: DailyDigest, config: DeliveryConfig) -> list[tuple]:
    sends = {"email": partial(_mail, digest, config), "webhook": partial(_post, digest, config)}
    return [(channel, target, sends[channel]) for channel, target in target_names(config)]


def _mail(digest: DailyDigest, config: DeliveryConfig) -> None:
    smtp = config.smtp
    assert smtp is not None  # target_names lists email only with its settings
    message = email_message(digest, smtp.sender, config.email_to, config.site_url)
    send_email(smtp, message, config.email_to)


def _post(digest: DailyDigest, config: DeliveryConfig) -> None:
    assert config.webhook_url is not None
    post_webhook(config.webhook_url, slack_payload(digest, config.site_url))
