"""What `nightshift router` is told: its backends (URLs, or a DNS name whose addresses are the
replicas), the routing policy and the health-check cadence; checked at construction, so that a
bad value is one line before anything listens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine.router.policy import POLICIES
from engine.router.prefix_key import DEFAULT_BLOCK_CHARS


class RouterConfigError(ValueError):
    """A router option that cannot work (no backend, a bad URL, a bad number)."""


@dataclass(slots=True)
class RouterConfig:
    backends: list[str] = field(default_factory=list)  # server roots, http://host:port
    # host:port names whose A/AAAA records are the replicas (a Kubernetes headless Service),
    # resolved again at every health check.
    backend_dns: list[str] = field(default_factory=list)
    policy: str = "prefix"
    prefix_block_chars: int = DEFAULT_BLOCK_CHARS
    min_prefix_match: float = 0.5
    balance_abs: int = 8
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    health_failures: int = 2  # consecutive failed checks that take a replica out of rotation
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # the longest gap between two bytes of a replica's answer
    max_request_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        self.backends = [normalize_backend(b) for b in self.backends]
        if len(set(self.backends)) != len(self.backends):
            raise RouterConfigError("--backend names the same server twice")
        for name in self.backend_dns:
            split_host_port(name)
        if not self.backends and not self.backend_dns:
            raise RouterConfigError("the router needs a backend: --backend URL or --backend-dns")
        if self.policy not in POLICIES:
            raise RouterConfigError(
                f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}"
            )
        _at_least("--prefix-block-chars", self.prefix_block_chars, 1)
        _at_least("--health-failures", self.health_failures, 1)
        _at_least("--balance-abs", self.balance_abs, 0)
        _at_least("--max-request-bytes", self.max_request_bytes, 1)
        if not 0 < self.min_prefix_match <= 1:
            raise RouterConfigError(
                f"--min-prefix-match must be in (0, 1], got {self.min_prefix_match}"
            )
        for flag, value in (
            ("--health-interval", self.health_interval_s),
            ("--health-timeout", self.health_timeout_s),
            ("--connect-timeout", self.connect_timeout_s),
            ("--read-timeout", self.read_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise RouterConfigError(f"{flag} must be a number of seconds > 0, got {value}")


def _at_least(flag: str, value: int, low: int) -> None:
    if value < low:
        raise RouterConfigError(f"{flag} must be at least {low}, got {value}")


def normalize_backend(url: str) -> str:
    """A backend's root URL: http(s), a host, a port from 1 to 65535; a trailing /v1 (the base
    URL clients are given) is taken off, since the router forwards paths as they come."""
    bad = f"--backend must be an http(s) URL like http://127.0.0.1:8001, not {url!r}"
    if not url.startswith(("http://", "https://")):
        raise RouterConfigError(bad)
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise RouterConfigError(f"{bad}: a bad host or port (1 to 65535)") from None
    if not host or port == 0:
        raise RouterConfigError(f"{bad}: no host, or port 0")
    if parts.query or parts.fragment:
        raise RouterConfigError(f"{bad}: no query or fragment")
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


def split_host_port(name: str) -> tuple[str, int]:
    """`host:port` of --backend-dns."""
    host, sep, port = name.rpartition(":")
    bad = f"--backend-dns must be HOST:PORT (e.g. nightshift-engines:8000), not {name!r}"
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise RouterConfigError(bad)
    return host.strip("[]"), int(port)
