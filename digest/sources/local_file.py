"""Papers from a file: a saved arXiv API response (.xml/.atom) or JSON/JSONL records.

JSON is a list of records or an object with a `papers` list; JSONL has one record a line. A record
has `id, title, abstract, authors, categories` and optionally `published`/`updated` (ISO 8601).
`authors` and `categories` may be lists or strings (comma-separated; categories also by spaces).
Every paper in the file is taken, whatever its date: the file is what the user chose to digest."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from digest.paper import InvalidArxivId, Paper, parse_arxiv_id
from digest.sources.arxiv_api import keep_latest_versions, normalize_space, parse_atom, unique
from digest.sources.polite_http import SourceError
from workload.input_file import BadInputFile, parse_json, read_text, text_lines

REQUIRED_FIELDS = ("id", "title", "abstract", "authors", "categories")
_ATOM_SUFFIXES = {".xml", ".atom"}
_JSONL_SUFFIXES = {".jsonl", ".ndjson"}


class BadPapersFile(BadInputFile, SourceError):
    """The file cannot be digested as it is (unreadable, not JSON or Atom, a bad record, no
    papers): a setup mistake, exit 2, unlike a source that fails on the night (exit 1)."""


def load_papers_file(path: Path, max_papers: int | None) -> list[Paper]:
    """The file's papers in file order, one per arXiv id (highest version), up to `max_papers`.
    Raises BadPapersFile naming the file (and the line) when it cannot be used."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise BadPapersFile(path, f"cannot read ({exc.strerror or exc})") from None
    suffix = path.suffix.lower()
    if suffix in _ATOM_SUFFIXES or (suffix not in _JSONL_SUFFIXES and head.lstrip()[:1] == b"<"):
        try:
            papers = parse_atom(path.read_bytes(), str(path), strict=True)
        except SourceError as exc:
            raise BadPapersFile(path, str(exc).removeprefix(f"{path}: ")) from None
    else:
        # The workload readers' checks: UTF-8 line by line, JSON without the recursion and
        # giant-integer holes; all of them raise BadInputFile naming the line.
        try:
            records = _jsonl_records(path) if suffix in _JSONL_SUFFIXES else _json(path)
        except BadInputFile as exc:
            raise BadPapersFile(path, exc.problem, exc.line) from None
        papers = keep_latest_versions(_paper(record, where, path) for where, record in records)
    if not papers:
        # An empty file is a wrong path or a failed export, not a quiet night.
        raise BadPapersFile(path, "no papers in the file")
    return papers[:max_papers]


def _json(path: Path) -> list[tuple[str, Any]]:
    text = read_text(path)
    if not text.strip():
        return []  # refused below as "no papers", like an empty JSONL file
    document = parse_json(text, path)
    if isinstance(document, dict) and "papers" in document:
        document = document["papers"]
    if not isinstance(document, list):
        raise BadPapersFile(path, "expected a list of papers or an object with a 'papers' list")
    return [(f"entry {number}", record) for number, record in enumerate(document, start=1)]


def _jsonl_records(path: Path) -> list[tuple[str, Any]]:
    return [
        (f"line {number}", parse_json(line, path, number))
        for number, line in text_lines(path)
        if line.strip()
    ]


def _paper(record: Any, where: str, path: Path) -> Paper:
    if not isinstance(record, dict):
        raise BadPapersFile(path, f"{where} is not an object")
    for name in REQUIRED_FIELDS:
        if record.get(name) in (None, ""):
            raise BadPapersFile(path, f"{where} has no '{name}'")
    try:
        arxiv_id, version = parse_arxiv_id(_text(record, "id", where, path))
    except InvalidArxivId as exc:
        raise BadPapersFile(path, f"{where}: {exc}") from None
    return Paper(
        arxiv_id=arxiv_id,
        title=normalize_space(_text(record, "title", where, path)),
        abstract=normalize_space(_text(record, "abstract", where, path)),
        authors=_names(record, "authors", r",", where, path),
        categories=_names(record, "categories", r"[,\s]+", where, path),
        version=version or 1,
        published=_time(record, "published", where, path),
        updated=_time(record, "updated", where, path),
    )


def _text(record: dict[str, Any], name: str, where: str, path: Path) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise BadPapersFile(path, f"{where}: '{name}' must be a string")
    return value


def _names(record: dict[str, Any], name: str, separator: str, where: str, path: Path) -> list[str]:
    """A list field that may also be written as one separated string."""
    value = record[name]
    if isinstance(value, str):
        value = re.split(separator, value)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadPapersFile(path, f"{where}: '{name}' must be a list of strings or a string")
    return unique(normalize_space(item) for item in value)


def _time(record: dict[str, Any], name: str, where: str, path: Path) -> datetime | None:
    value = record.get(name)
    if value in (None, ""):
        return None
    try:
        moment = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        moment = None
    if moment is None:
        raise BadPapersFile(path, f"{where}: '{name}' is not an ISO 8601 time: {value!r}")
    # A time without a zone is taken as UTC, the zone arXiv states its times in.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
