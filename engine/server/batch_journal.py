"""A batch's output and error files as journals: each finished line is appended the moment it
ends, in one write(2) with O_APPEND, so a server killed at any instant leaves every finished line
on disk, at most one torn last line, and nothing twice. Reading a journal back (on resume) drops a
torn tail and says which custom_ids are done, so that those are never run again."""

from __future__ import annotations

import json
import os
from pathlib import Path


def append(path: Path, record: dict) -> None:
    data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write (a full disk) must not leave half a line
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def recover(path: Path) -> list[str]:
    """The custom_ids the journal holds, in order; a last line without its newline (the process
    died inside the write) is cut off first, so the next append starts a fresh line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
        data = data[:end]
    ids = []
    for raw in data.splitlines():
        try:
            ids.append(json.loads(raw)["custom_id"])
        except (ValueError, KeyError, TypeError):
            continue  # not ours to repair; it names no request
    return ids


def sync(path: Path) -> None:
    """Flush a finished journal to the disk itself (a power cut, not only a killed process)."""
    if path.exists():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
