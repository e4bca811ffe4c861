"""`nightshift digest profile add|remove|show`: the reader profile that ranks the digest
(digest/profile.py, digest/ranking.py).

A liked paper is looked up in the digest store (its title and abstract are copied into the
profile); an id the store does not hold is an error naming it, as is a library file that cannot
be read. The profile file is replaced atomically, and only after every argument was checked: a
bad argument changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nightshift.cli_errors import EXIT_USAGE, fail

profile_app = typer.Typer(no_args_is_help=True, help="The reader profile that ranks the digest.")

PathOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        envvar="NIGHTSHIFT_PROFILE",
        help="The profile file. Default: $NIGHTSHIFT_HOME/profile.json.",
    ),
]
KeywordOpt = Annotated[
    list[str] | None, typer.Option("--keyword", help="A word or phrase (repeatable).")
]
AuthorOpt = Annotated[
    list[str] | None, typer.Option("--author", help="An author's name as arXiv lists it.")
]
LikeOpt = Annotated[
    list[str] | None,
    typer.Option("--like", metavar="PAPER_ID", help="An arXiv id from a stored digest."),
]
DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Database URL. Default: $NIGHTSHIFT_DATABASE_URL or SQLite."),
]


def _path(value: Path | None) -> Path:
    from digest.profile import default_profile_path

    return value if value is not None else default_profile_path()


def _load(path: Path):  # -> ReaderProfile
    from digest.profile import ProfileError, ReaderProfile, load_profile

    if not path.exists():
        return ReaderProfile()
    try:
        return load_profile(path)
    except ProfileError as exc:
        raise fail(str(exc)) from None


def _paper_ids(values: list[str]) -> list[str]:
    from digest.paper import InvalidArxivId, parse_arxiv_id

    try:
        return [parse_arxiv_id(v)[0] for v in values]
    except InvalidArxivId as exc:
        raise fail(f"--like: {exc}") from None


@profile_app.command("add")
def profile_add(
    keyword: KeywordOpt = None,
    author: AuthorOpt = None,
    like: LikeOpt = None,
    library: Annotated[
        Path | None,
        typer.Option(help="A BibTeX (.bib) or CSL JSON (.json) export, e.g. from Zotero."),
    ] = None,
    tag: Annotated[
        str | None,
        typer.Option(help="The tag of --like and --library papers (default: liked / library)."),
    ] = None,
    profile: PathOpt = None,
    db: DbOpt = None,
) -> None:
    """Add keywords, followed authors, liked papers or a library to the profile."""
    from digest.library_file import read_library
    from digest.profile import LIKED_TAG, ProfileError, TaggedPaper, from_library, save_profile
    from workload.input_file import BadInputFile

    path = _path(profile)
    reader = _load(path)
    liked_ids = _paper_ids(like or [])
    if not (keyword or author or liked_ids or library):
        raise fail("nothing to add: give --keyword, --author, --like or --library")
    try:
        reader.add_keywords(keyword or [])
        reader.add_authors(author or [])
        if liked_ids:
            liked = [TaggedPaper(p.title, p.abstract, p.arxiv_id) for p in _stored(liked_ids, db)]
            name = LIKED_TAG if tag is None else tag  # --tag "" is refused, not the default
            added = reader.tag(name, liked)
            typer.echo(f"{added} liked paper(s) added under tag {name.strip()!r}")
        if library is not None:
            papers = from_library(read_library(library))
            name = "library" if tag is None else tag
            added = reader.tag(name, papers)
            typer.echo(f"{library}: {added} new of {len(papers)} paper(s) under tag {name!r}")
        save_profile(path, reader)
    except (ProfileError, BadInputFile) as exc:
        raise fail(str(exc)) from None
    typer.echo(f"wrote {path}")


def _stored(paper_ids: list[str], db: str | None) -> list:
    """The papers from the digest store; an id it does not hold is an error (exit 2)."""
    from digest.store import migrate
    from digest.store.database import StoreError, open_database
    from digest.store.digest_store import DigestStore

    try:
        # Only read: a mistyped --db must not leave a new empty database behind.
        engine = open_database(db, create=False)
    except StoreError as exc:
        raise fail(f"--like needs the digest store: {exc}") from None
    migrate.upgrade(engine)
    found = DigestStore(engine).papers(paper_ids)
    missing = [pid for pid in paper_ids if pid not in found]
    if missing:
        raise fail(
            f"--like {missing[0]}: no such paper in the digest store (like papers a digest "
            "listed, or import a library file that has it with --library)",
            EXIT_USAGE,
        )
    return [found[pid] for pid in paper_ids]


@profile_app.command("remove")
def profile_remove(
    keyword: KeywordOpt = None,
    author: AuthorOpt = None,
    like: LikeOpt = None,
    tag: Annotated[str | None, typer.Option(help="Remove this tag and all its papers.")] = None,
    profile: PathOpt = None,
) -> None:
    """Remove keywords, authors, papers or a whole tag from the profile."""
    from digest.profile import ProfileError, save_profile

    path = _path(profile)
    if not path.exists():
        raise fail(f"no profile at {path}")
    reader = _load(path)
    try:
        reader.remove(keyword or [], author or [], _paper_ids(like or []))
        if tag is not None:
            reader.drop_tag(tag)
        save_profile(path, reader)
    except ProfileError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"wrote {path}")


@profile_app.command("show")
def profile_show(profile: PathOpt = None) -> None:
    """Print the profile: keywords, authors, and each tag's papers."""
    path = _path(profile)
    if not path.exists():
        raise fail(f"no profile at {path}; create one with `nightshift digest profile add`")
    reader = _load(path)
    typer.echo(f"profile {path}")
    typer.echo(f"keywords: {', '.join(reader.keywords) or '-'}")
    typer.echo(f"authors: {', '.join(reader.authors) or '-'}")
    for name, papers in reader.tags.items():
        typer.echo(f"tag {name}: {len(papers)} paper(s)")
        for paper in papers:
            typer.echo(f"  {paper.arxiv_id or '-'}  {paper.title}")
