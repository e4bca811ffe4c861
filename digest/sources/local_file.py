"""Papers from a file: a saved arXiv API response (.xml/.atom) or JSON/JSONL records.

JSON is a list of records or an object with a `papers` list; JSONL has one record a line. A record
has `id, title, abstract, authors, categories` and optionally `published`/`updated` (ISO 8601).
`authors` and `categories` may be lists or strings (comma-separated; categories also by spaces).
Every paper in the file is taken, whatever its date: the file is what the user chose to digest."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from digest.paper import InvalidArxivId, Paper, parse_arxiv_id
from digest.sources.arxiv_api import keep_latest_versions, normalize_space, parse_atom, unique
from digest.sources.polite_http import SourceError

REQUIRED_FIELDS = ("id", "title", "abstract", "authors", "categories")
_ATOM_SUFFIXES = {".xml", ".atom"}
_JSONL_SUFFIXES = {".jsonl", ".ndjson"}


def load_papers_file(path: Path, max_papers: int | None) -> list[Paper]:
    """The file's papers in file order, one per arXiv id (highest version), up to `max_papers`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    suffix = path.suffix.lower()
    if suffix in _ATOM_SUFFIXES or (suffix not in _JSONL_SUFFIXES and data.lstrip()[:1] == b"<"):
        papers = parse_atom(data, str(path))
    else:
        text = _decode(data, path)
        records = _jsonl_records(text, path) if suffix in _JSONL_SUFFIXES else _json(text, path)
        papers = keep_latest_versions(_paper(record, where, path) for where, record in records)
    return papers[:max_papers]


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _json(text: str, path: Path) -> list[tuple[str, Any]]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    if isinstance(document, dict) and "papers" in document:
        document = document["papers"]
    if not isinstance(document, list):
        raise SourceError(f"{path}: expected a list of papers or an object with a 'papers' list")
    return [(f"entry {number}", record) for number, record in enumerate(document, start=1)]


def _jsonl_records(text: str, path: Path) -> list[tuple[str, Any]]:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}: invalid JSON at line {lineno}: {exc.msg}") from exc
    return records


def _paper(record: Any, where: str, path: Path) -> Paper:
    if not isinstance(record, dict):
        raise SourceError(f"{path}: {where} is not an object")
    for name in REQUIRED_FIELDS:
        if record.get(name) in (None, ""):
            raise SourceError(f"{path}: {where} has no '{name}'")
    try:
        arxiv_id, version = parse_arxiv_id(_text(record, "id", where, path))
    except InvalidArxivId as exc:
        raise SourceError(f"{path}: {where}: {exc}") from exc
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
        raise SourceError(f"{path}: {where}: '{name}' must be a string")
    return value


def _names(record: dict[str, Any], name: str, separator: str, where: str, path: Path) -> list[str]:
    """A list field that may also be written as one separated string."""
    value = record[name]
    if isinstance(value, str):
        value = re.split(separator, value)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise SourceError(f"{path}: {where}: '{name}' must be a list of strings or a string")
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
        raise SourceError(f"{path}: {where}: '{name}' is not an ISO 8601 time: {value!r}")
    # A time without a zone is taken as UTC, the zone arXiv states its times in.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
