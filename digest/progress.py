"""Per-paper progress: a bar on a terminal, one log line per paper otherwise (cron, systemd)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rich.progress import Progress

log = logging.getLogger("digest.progress")


class ProgressSink(Protocol):
    def start(self, total: int) -> None: ...

    def advance(self, paper_id: str, outcome: str) -> None: ...


class LogProgress:
    def __init__(self) -> None:
        self.total = 0
        self.count = 0

    def start(self, total: int) -> None:
        self.total = total

    def advance(self, paper_id: str, outcome: str) -> None:
        self.count += 1
        log.info("[%d/%d] %s %s", self.count, self.total, paper_id, outcome)


class BarProgress:
    def __init__(self, bar: Progress) -> None:
        self.bar = bar
        self.task = None
        self.failures = 0

    def start(self, total: int) -> None:
        self.task = self.bar.add_task("papers", total=total)

    def advance(self, paper_id: str, outcome: str) -> None:
        if outcome != "done":
            self.failures += 1
            self.bar.console.print(f"{paper_id}: {outcome}")
        self.bar.update(self.task, advance=1, description=f"papers ({self.failures} failed)")


@contextmanager
def paper_progress() -> Iterator[ProgressSink]:
    if not sys.stderr.isatty():
        yield LogProgress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as bar:
        yield BarProgress(bar)
