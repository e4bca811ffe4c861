"""An HTTP client that is polite to arXiv: a request interval, retries with backoff, Retry-After.

arXiv asks API users for at most one request every 3 seconds and answers bursts with 429/503;
every source in this package goes through one `PoliteClient` so that the interval holds across
pages, feeds and full-text fetches of one run."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType

import httpx

# Statuses worth another try: throttling (429, 503), arXiv's occasional 406 under load, gateways.
RETRY_STATUSES = frozenset({406, 429, 500, 502, 503, 504})
ATOM_ACCEPT = "application/atom+xml, application/xml;q=0.9, */*;q=0.1"


class SourceError(Exception):
    """A source could not deliver papers; the message names the URL or file and the cause."""


class SourceUnreachable(SourceError):
    """The network could not be reached (connection refused, DNS) even after retries."""


@dataclass(slots=True)
class PoliteHttpConfig:
    min_interval_s: float = 3.0  # between the starts of two requests, retries included
    max_retries: int = 4  # further attempts after the first one
    backoff_s: float = 2.0  # first retry delay; doubles each retry
    max_backoff_s: float = 60.0  # cap on any wait, Retry-After included
    timeout_s: float = 30.0
    user_agent: str = "nightshift-digest/0.1 (nightly paper digest; https://github.com/nightshift)"


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None if absent
    or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; a date without a zone is read as UTC
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class HttpStatusError(SourceError):
    """A non-retryable error status; keeps the response so a caller can read an error body."""

    def __init__(self, url: str, response: httpx.Response) -> None:
        excerpt = " ".join(response.text[:200].split())
        super().__init__(f"{url}: HTTP {response.status_code} {response.reason_phrase}: {excerpt}")
        self.response = response


@dataclass(slots=True)
class _Failure:
    """Why one attempt failed; `response` carries a throttling reply's Retry-After."""

    reason: str
    unreachable: bool  # the network, not the server, failed (connection refused, DNS)
    response: httpx.Response | None = None
    no_dns: bool = False  # the host name did not resolve


class PoliteClient:
    """A sync httpx client that spaces requests, retries transient failures and raises
    `SourceError` for the rest. A 404 is returned as is: callers decide what absence means."""

    def __init__(self, config: PoliteHttpConfig | None = None) -> None:
        self.config = config or PoliteHttpConfig()
        self._http = httpx.Client(
            timeout=self.config.timeout_s,
            headers={"User-Agent": self.config.user_agent},
            follow_redirects=True,
        )
        self._last_start: float | None = None

    def __enter__(self) -> PoliteClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(
        self, url: str, params: dict[str, str | int] | None = None, accept: str = ATOM_ACCEPT
    ) -> httpx.Response:
        shown = str(httpx.URL(url, params=params))
        failure = _Failure("not attempted", unreachable=False)
        for attempt in range(self.config.max_retries + 1):
            if attempt > 0:
                time.sleep(self._backoff(attempt, failure.response))
            self._wait_turn()
            outcome = self._attempt(url, params, accept)
            if isinstance(outcome, _Failure) and outcome.no_dns:
                # A name that does not resolve will not resolve in a minute either: no network
                # (or a wrong host). Fail at once so the user hears about it now.
                raise SourceUnreachable(f"{shown}: {outcome.reason}")
            if isinstance(outcome, _Failure):
                failure = outcome
                continue
            if outcome.status_code >= 400 and outcome.status_code != 404:
                raise HttpStatusError(shown, outcome)
            return outcome
        message = f"{shown}: {failure.reason} after {self.config.max_retries + 1} attempts"
        raise SourceUnreachable(message) if failure.unreachable else SourceError(message)

    def _attempt(
        self, url: str, params: dict[str, str | int] | None, accept: str
    ) -> httpx.Response | _Failure:
        """One request; a transient failure comes back as a `_Failure` to retry."""
        try:
            response = self._http.get(url, params=params, headers={"Accept": accept})
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # refused, DNS, no route
            reason = f"cannot connect ({exc or type(exc).__name__})"
            return _Failure(reason, unreachable=True, no_dns=_name_not_resolved(exc))
        except httpx.TransportError as exc:  # read timeouts, dropped connections
            return _Failure(f"{type(exc).__name__} ({exc})", unreachable=False)
        if response.status_code in RETRY_STATUSES:
            return _Failure(f"HTTP {response.status_code}", unreachable=False, response=response)
        return response

    def _wait_turn(self) -> None:
        now = time.monotonic()
        if self._last_start is not None:
            wait = self._last_start + self.config.min_interval_s - now
            if wait > 0:
                time.sleep(wait)
                now = time.monotonic()
        self._last_start = now

    def _backoff(self, attempt: int, response: httpx.Response | None) -> float:
        delay = self.config.backoff_s * 2 ** (attempt - 1)
        if response is not None:
            asked = retry_after_seconds(response.headers.get("Retry-After"))
            if asked is not None:
                delay = asked
        return min(delay, self.config.max_backoff_s)


def _name_not_resolved(exc: BaseException) -> bool:
    """True when the error chain holds a DNS failure (socket.gaierror)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, socket.gaierror):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
