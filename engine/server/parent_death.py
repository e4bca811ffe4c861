"""Run a command that dies with the process that started it:
`python -m engine.server.parent_death PID CMD...` asks Linux for SIGKILL when its parent dies
(prctl PR_SET_PDEATHSIG), checks that PID is still its parent, then becomes CMD (exec keeps the
process and the setting).

The digest's local `nightshift serve` is started this way, so that a digest killed by SIGTERM or
`kill -9` does not leave a 3 GB server listening behind it. A shim process is used rather than
Popen's preexec_fn, which is not safe in a process that runs threads (the digest does).
The signal fires when the thread that started the child ends: the digest starts and stops the
server in the same thread (the main one, or the scheduler's worker for one run)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask for SIGKILL when the parent dies; False where the OS has no such request."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def command(parent_pid: int, cmd: list[str]) -> list[str]:
    """`cmd` wrapped so that it dies with `parent_pid`."""
    return [sys.executable, "-m", "engine.server.parent_death", str(parent_pid), *cmd]


def main(argv: list[str]) -> None:
    parent_pid, cmd = int(argv[0]), argv[1:]
    die_with_parent()
    # The parent may have died before the request was made: then no signal will come.
    if os.getppid() != parent_pid:
        sys.exit(f"parent {parent_pid} is gone; not starting {cmd[0]}")
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
