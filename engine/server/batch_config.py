"""What the Batch API is allowed: where its records and file bodies live, how large an input file
may be, how many of its lines run at once and at which scheduler priority, and how long a
completion window may be."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.model_fetch import nightshift_home

BATCH_DATABASE_URL_ENV = "NIGHTSHIFT_BATCH_DATABASE_URL"
# The endpoints a batch's lines may call. /v1/embeddings is served too (OpenAI's list has it).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class BatchConfig:
    # Records: $NIGHTSHIFT_BATCH_DATABASE_URL, else a SQLite file in `home`.
    database_url: str | None = None
    home: Path | None = None  # file bodies; default $NIGHTSHIFT_HOME/batches
    max_file_bytes: int = 100 << 20  # one uploaded file (OpenAI: 200 MB)
    max_lines: int = 50_000  # requests in one batch (OpenAI's limit)
    # Lines of all batches in the engine at once: the rest of max_num_seqs stays free for the
    # live endpoint, which also wins every wait for a slot (priority below).
    concurrency: int = 4
    # The scheduler takes waiting requests by (priority, arrival), lower first; interactive
    # requests default to 0, so a batch line waits behind every one of them.
    priority: int = 10

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1:
            raise ValueError(f"batch max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.max_lines < 1:
            raise ValueError(f"batch max_lines must be >= 1, got {self.max_lines}")
        if self.concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {self.concurrency}")

    def files_dir(self) -> Path:
        return Path(self.home) if self.home is not None else nightshift_home() / "batches"

    def url(self) -> str:
        if self.database_url:
            return self.database_url
        if url := os.environ.get(BATCH_DATABASE_URL_ENV):
            return url
        return f"sqlite:///{self.files_dir() / 'batches.db'}"


def window_seconds(window: str) -> int | None:
    """Seconds of a completion window: OpenAI's "24h", or any whole number of s, m or h up to a
    week (shorter nights, and tests of expiry); None when it is not one."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None:
        return None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    return seconds if seconds <= MAX_WINDOW_S else None
