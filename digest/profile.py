"""A reader's profile: what the digest ranks papers by (digest/ranking.py).

It holds keywords, followed authors, and tagged papers: liked papers (`digest profile add --like
ID`, looked up in the digest store) and the papers of an imported library (BibTeX or CSL JSON).
Each tag trains its own classifier, as arxiv-sanity-lite's tags do, so that a library of 500
papers on one topic does not drown three liked papers on another.

The profile is one JSON file (`--profile`, `$NIGHTSHIFT_PROFILE`, else
`$NIGHTSHIFT_HOME/profile.json`), written atomically, holding each tagged paper's title and
abstract: ranking then needs neither the library file nor the store to still have the paper."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from digest.library_file import LibraryPaper
from workload.input_file import BadInputFile, read_json

PROFILE_VERSION = 1
LIKED_TAG = "liked"


class ProfileError(ValueError):
    """A profile that cannot be used, or a change that cannot be made; the message names it."""


@dataclass(slots=True)
class TaggedPaper:
    title: str
    abstract: str = ""
    arxiv_id: str | None = None

    @property
    def text(self) -> str:
        return f"{self.title}. {self.abstract}"


@dataclass(slots=True)
class ReaderProfile:
    keywords: list[str] = field(default_factory=list)
    authors: list[str] = field(default_factory=list)
    tags: dict[str, list[TaggedPaper]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.keywords or self.authors or any(self.tags.values()))

    def tagged_ids(self) -> set[str]:
        return {p.arxiv_id for papers in self.tags.values() for p in papers if p.arxiv_id}

    def add_keywords(self, words: list[str]) -> None:
        self.keywords = _merged(self.keywords, words)

    def add_authors(self, names: list[str]) -> None:
        self.authors = _merged(self.authors, names)

    def tag(self, tag: str, papers: list[TaggedPaper]) -> int:
        """Add papers under `tag`; a paper already there (same arXiv id, else same title) is
        replaced, not doubled. Returns how many are new."""
        if not tag.strip():
            raise ProfileError("a tag name cannot be empty")
        have = self.tags.setdefault(tag.strip(), [])
        index = {_identity(p): i for i, p in enumerate(have)}
        added = 0
        for paper in papers:
            key = _identity(paper)
            if key in index:
                have[index[key]] = paper
            else:
                index[key] = len(have)
                have.append(paper)
                added += 1
        return added

    def remove(self, keywords: list[str], authors: list[str], paper_ids: list[str]) -> None:
        """Remove these entries; one that the profile does not hold is an error naming it."""
        for kind, values, have in (
            ("keyword", keywords, self.keywords),
            ("author", authors, self.authors),
        ):
            folded = {v.casefold() for v in have}
            missing = [v for v in values if v.casefold() not in folded]
            if missing:
                raise ProfileError(f"the profile has no {kind} {missing[0]!r}")
        self.keywords = [
            k for k in self.keywords if k.casefold() not in {v.casefold() for v in keywords}
        ]
        self.authors = [
            a for a in self.authors if a.casefold() not in {v.casefold() for v in authors}
        ]
        for paper_id in paper_ids:
            if paper_id not in self.tagged_ids():
                raise ProfileError(f"the profile has no paper {paper_id}")
            for tag, papers in list(self.tags.items()):
                self.tags[tag] = [p for p in papers if p.arxiv_id != paper_id]
        self.tags = {tag: papers for tag, papers in self.tags.items() if papers}

    def drop_tag(self, tag: str) -> None:
        if tag not in self.tags:
            raise ProfileError(
                f"the profile has no tag {tag!r} (tags: {', '.join(self.tags) or 'none'})"
            )
        del self.tags[tag]


def _identity(paper: TaggedPaper) -> str:
    return paper.arxiv_id or " ".join(paper.title.casefold().split())


def _merged(have: list[str], more: list[str]) -> list[str]:
    out = list(have)
    folded = {v.casefold() for v in have}
    for value in more:
        value = " ".join(value.split())
        if not value:
            raise ProfileError("an empty keyword or author name")
        if value.casefold() not in folded:
            folded.add(value.casefold())
            out.append(value)
    return out


def from_library(papers: list[LibraryPaper]) -> list[TaggedPaper]:
    return [TaggedPaper(p.title, p.abstract, p.arxiv_id) for p in papers]


def default_profile_path() -> Path:
    from engine.model_fetch import nightshift_home

    if env := os.environ.get("NIGHTSHIFT_PROFILE"):
        return Path(env)
    return nightshift_home() / "profile.json"


def load_profile(path: Path) -> ReaderProfile:
    """The profile in `path`; ProfileError names a file that is not one."""
    try:
        data = read_json(path)
    except BadInputFile as exc:
        raise ProfileError(f"profile {exc}") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"profile {path}: not a Nightshift reader profile (version {PROFILE_VERSION})"
        )
    try:
        profile = ReaderProfile(
            keywords=_strings(data.get("keywords", []), "keywords"),
            authors=_strings(data.get("authors", []), "authors"),
            tags={
                str(tag): [_tagged(p) for p in papers]
                for tag, papers in _dict(data.get("tags", {})).items()
            },
        )
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"profile {path}: {exc}") from None
    return profile


def _strings(value: object, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of strings")
    return list(value)


def _dict(value: object) -> dict:
    if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
        raise ValueError("tags must map each tag to a list of papers")
    return value


def _tagged(value: object) -> TaggedPaper:
    if not isinstance(value, dict) or not isinstance(value.get("title"), str):
        raise ValueError("a tagged paper needs a title")
    abstract, arxiv_id = value.get("abstract", ""), value.get("arxiv_id")
    if not isinstance(abstract, str) or not (arxiv_id is None or isinstance(arxiv_id, str)):
        raise ValueError(f"tagged paper {value['title']!r}: abstract and arxiv_id must be strings")
    return TaggedPaper(value["title"], abstract, arxiv_id)


def save_profile(path: Path, profile: ReaderProfile) -> None:
    """Write the profile atomically (a crash leaves the old file, never half of one);
    ProfileError names a file that cannot be written."""
    from digest.render import write_atomic

    data = {"version": PROFILE_VERSION, **asdict(profile)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    except OSError as exc:  # a parent that is a file, a read-only or full file system
        where = exc.filename if exc.filename and str(exc.filename) != str(path) else None
        problem = exc.strerror or str(exc)
        if isinstance(exc, FileExistsError) and where:
            problem = "not a directory"
        raise ProfileError(
            f"cannot write profile {path}: {f'{where}: ' if where else ''}{problem}"
        ) from None
