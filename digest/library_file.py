"""A reader's library, as reference managers export it: BibTeX (`.bib`, Zotero's "Export
Library...", JabRef, Google Scholar) or CSL JSON (`.json`, Zotero's "CSL JSON" export).

Only what ranking needs is kept: each entry's title, abstract and arXiv id when it has one (in
`eprint`, `url`, `doi` 10.48550/arXiv.*, `number` or `note`). The BibTeX reader is small and
strict on structure (an entry whose braces do not close is an error naming its line: a silently
dropped half of a library would skew the ranking without anyone noticing) and lenient on content
(LaTeX markup is reduced to its words; TF-IDF does not need more)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from digest.clean_text import xml_safe
from digest.latex_text import latex_to_text
from digest.paper import InvalidArxivId, parse_arxiv_id
from workload.input_file import BadInputFile, read_json, read_text

MAX_ENTRIES = 100_000  # far above any personal library; bounds memory and training time


@dataclass(slots=True)
class LibraryPaper:
    title: str
    abstract: str = ""
    arxiv_id: str | None = None  # without version


def read_library(path: Path) -> list[LibraryPaper]:
    """The papers of a BibTeX or CSL JSON export; BadInputFile names what is wrong."""
    if path.is_dir():
        raise BadInputFile(path, "a directory, not a BibTeX or CSL JSON file")
    if path.suffix.lower() == ".json":
        papers = _csl_json(path)
    else:
        papers = [p for p in (_bib_paper(e) for e in parse_bibtex(read_text(path), path)) if p]
    if not papers:
        raise BadInputFile(path, "no entries with a title in the library file")
    if len(papers) > MAX_ENTRIES:
        raise BadInputFile(path, f"more than {MAX_ENTRIES} entries")
    return papers


# -- BibTeX ----------------------------------------------------------------------------------

_ENTRY_START = re.compile(r"@\s*([A-Za-z]+)\s*([{(])")
_FIELD_NAME = re.compile(r"\s*([A-Za-z][\w\-:.]*)\s*=\s*")
_SKIPPED = {"comment", "preamble", "string"}


def parse_bibtex(text: str, path: Path | str = "<bibtex>") -> list[dict[str, str]]:
    """Each entry's fields (lower-case names; `ENTRYTYPE` and `ID` as bibtexparser names them).
    Text outside entries is a comment, as in BibTeX itself."""
    entries: list[dict[str, str]] = []
    pos = 0
    line, counted = 1, 0  # the line of `counted`: newlines counted once, not from the top
    while match := _ENTRY_START.search(text, pos):
        line += text.count("\n", counted, match.start())
        counted = match.start()
        kind = match.group(1).lower()
        close = "}" if match.group(2) == "{" else ")"
        end = _matching(text, match.end(), close)
        if end is None:
            raise BadInputFile(path, f"@{kind} entry is not closed (unbalanced braces)", line)
        if kind not in _SKIPPED:
            entries.append(_entry_fields(kind, text[match.end() : end], path, line))
        pos = end + 1
    return entries


def _matching(text: str, start: int, close: str) -> int | None:
    """The index of the `close` that ends an entry opened just before `start`."""
    depth = 0
    for i in range(start, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return i if close == "}" else None
            depth -= 1
        elif char == close and depth == 0:
            return i
    return None


def _entry_fields(kind: str, body: str, path: Path | str, line: int) -> dict[str, str]:
    key, _, rest = body.partition(",")
    fields = {"ENTRYTYPE": kind, "ID": key.strip()}
    pos = 0
    while pos < len(rest):
        if not rest[pos:].strip(" \t\r\n,"):
            break
        name = _FIELD_NAME.match(rest, pos)
        if name is None:
            snippet = rest[pos:].strip()[:30]
            raise BadInputFile(
                path, f"@{kind}{{{key.strip()}: expected 'name = value' at {snippet!r}", line
            )
        value, pos = _value(rest, name.end(), path, line)
        fields[name.group(1).lower()] = value
        while pos < len(rest) and rest[pos] in " \t\r\n,":
            pos += 1
    return fields


def _value(text: str, pos: int, path: Path | str, line: int) -> tuple[str, int]:
    """A field value: {braced}, "quoted", a number or a @string name, joined by #."""
    parts: list[str] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text) and text[pos] == "{":
            end = _matching(text, pos + 1, "}")
            if end is None:
                raise BadInputFile(path, "a field value's braces are not closed", line)
            parts.append(text[pos + 1 : end])
            pos = end + 1
        elif pos < len(text) and text[pos] == '"':
            end = pos + 1
            depth = 0
            while end < len(text) and not (text[end] == '"' and depth == 0):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                end += 1
            if end >= len(text):
                raise BadInputFile(path, "a quoted field value is not closed", line)
            parts.append(text[pos + 1 : end])
            pos = end + 1
        else:
            word = re.match(r"[\w\-.:]+", text[pos:])
            if word is None:
                raise BadInputFile(path, "a field has no value", line)
            parts.append(word.group())
            pos += word.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text) and text[pos] == "#":
            pos += 1
            continue
        return "".join(parts), pos


# Old-style font switches (`{\\em Deep}`), common in BibTeX titles: markup, not words.
_FONT_SWITCH = re.compile(
    r"\\(?:em|bf|it|sl|sc|tt|rm|sf|up|md|normalfont|bfseries|itshape|slshape|scshape|upshape"
    r"|mdseries|rmfamily|sffamily|ttfamily|tiny|scriptsize|footnotesize|small|normalsize|large"
    r"|Large|LARGE|huge|Huge)(?![A-Za-z])\s*"
)


def latex_words(text: str) -> str:
    """Markup reduced to its text as the pages show LaTeX (digest/latex_text.py): accents
    kept in their word (`S{\\"a}tze` is Sätze, not "S atze"), `$\\alpha$` is α, `{\\em Deep}
    \\& {BERT}` is `Deep & BERT`."""
    return " ".join(xml_safe(latex_to_text(_FONT_SWITCH.sub("", text))).split())


def _bib_paper(fields: dict[str, str]) -> LibraryPaper | None:
    title = latex_words(fields.get("title", ""))
    if not title:
        return None
    candidates = [fields.get(k, "") for k in ("eprint", "arxivid", "url", "doi", "number", "note")]
    return LibraryPaper(title, latex_words(fields.get("abstract", "")), _arxiv_id(candidates))


# -- CSL JSON ----------------------------------------------------------------------------------


def _csl_json(path: Path) -> list[LibraryPaper]:
    data = read_json(path)
    if isinstance(data, dict) and isinstance(data.get("items"), list):
        data = data["items"]  # Better BibTeX's JSON wraps the list
    if not isinstance(data, list):
        raise BadInputFile(path, "not a CSL JSON export (expected a list of items)")
    papers = []
    for n, item in enumerate(data, 1):
        if not isinstance(item, dict):
            raise BadInputFile(path, f"item {n} is not an object")
        title = item.get("title")
        if not isinstance(title, str) or not title.strip():
            continue
        abstract = item.get("abstract")
        strings = [item.get(k) for k in ("URL", "DOI", "number", "note", "archive_location")]
        papers.append(
            LibraryPaper(
                " ".join(xml_safe(title).split()),
                " ".join(xml_safe(abstract).split()) if isinstance(abstract, str) else "",
                _arxiv_id([s for s in strings if isinstance(s, str)]),
            )
        )
    return papers


_ARXIV_IN_TEXT = re.compile(
    r"(?:arxiv\.org/(?:abs|pdf)/|arxiv[.:]\s*)(\d{4}\.\d{4,5}(?:v\d+)?|[a-z\-]+(?:\.[A-Z]{2})?/\d{7})",
    re.IGNORECASE,
)
_BARE_ID = re.compile(r"\d{4}\.\d{4,5}(?:v\d+)?")


def _arxiv_id(candidates: list[str]) -> str | None:
    """The first arXiv id among the fields: a URL, `arXiv:ID`, a DataCite DOI or a bare id."""
    for text in candidates:
        found = _ARXIV_IN_TEXT.search(text) or _BARE_ID.fullmatch(text.strip())
        if found is None:
            continue
        raw = found.group(1) if found.re is _ARXIV_IN_TEXT else found.group()
        try:
            return parse_arxiv_id(raw)[0]
        except InvalidArxivId:
            continue
    return None
