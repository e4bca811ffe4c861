"""SIGTERM in `digest run` unwinds like an error, so that a stopped run cleans up as a failed one
does: the local server is stopped, the run is recorded as failed, the job lock is released (a
second host need not wait for its lease to expire). Then the process dies by SIGTERM after all,
which is what systemd and a shell expect of a terminated process. A second SIGTERM during the
cleanup kills at once; the local server dies with the process either way
(`engine.server.parent_death`)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM; a BaseException so that no `except Exception`
    swallows it."""


def _raise(_signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated("stopped by SIGTERM")


@contextmanager
def sigterm_unwinds(message: str) -> Iterator[None]:
    """Within the block SIGTERM raises Terminated; leaving by it prints `message` and dies."""
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    except Terminated:
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise  # only where the signal is not delivered at once
    finally:
        signal.signal(signal.SIGTERM, previous)
