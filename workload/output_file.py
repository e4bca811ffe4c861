"""Paths a command writes to (-o FILE, --json FILE, --plots FOLDER), checked before any work: a
mistyped path must end in one line and exit 2 at the start, not after a long replay or report,
and must not silently create a folder tree (or, for a folder given as -o FILE, files beside it).
So the folder an output goes into must already exist; a FOLDER option's own folder is created."""

from __future__ import annotations

from pathlib import Path


class BadOutputPath(ValueError):
    """An output path that cannot be written as asked; `str()` names the option and the path."""


def check_file(path: Path, option: str) -> None:
    """path can be written as a file: not a folder, and its folder exists."""
    path = Path(path)
    if path.is_dir():
        raise BadOutputPath(f"{option} {path} is a folder; give the file to write")
    _parent_exists(path, option)


def check_folder(path: Path, option: str) -> None:
    """path is a folder, or can be made one inside an existing folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise BadOutputPath(f"{option} {path} is a file, not a folder")
    _parent_exists(path, option)


def _parent_exists(path: Path, option: str) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise BadOutputPath(f"{option} {path}: the folder {parent} does not exist")
