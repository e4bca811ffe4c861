"""One backend as the router and the digest see it: its URL, whether it is in rotation, and the
requests it has in flight."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Replica:
    url: str  # the server's root, e.g. http://10.0.0.5:8000 (the router), or a /v1 base URL
    healthy: bool = False  # in rotation: the last health check passed, no connection failed since
    outstanding: int = 0  # requests sent and not yet answered to their end
    failures: int = 0  # consecutive failed health checks
    ever_healthy: bool = False
    last_error: str = ""  # why it is out of rotation, for /health and the log
