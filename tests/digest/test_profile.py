"""The reader profile: library files (BibTeX, CSL JSON) read as reference managers write them,
bad ones refused with the line and the problem, and `nightshift digest profile` changing the
profile only when every argument is good."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from digest.library_file import parse_bibtex, read_library
from digest.paper import Paper
from digest.profile import ProfileError, ReaderProfile, TaggedPaper, load_profile, save_profile
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from nightshift.cli import app
from workload.input_file import BadInputFile

BIB = r"""
This line is a comment, as BibTeX treats text between entries.
@string{acl = "Proceedings of ACL"}
@comment{jabref-meta: databaseType:bibtex;}
@article{leviathan2023,
  title = {Fast Inference from Transformers via {S}peculative {D}ecoding},
  author = {Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
  abstract = {Inference from large autoregressive models is slow; we use \emph{draft} models.},
  eprint = {2211.17192},
  archivePrefix = {arXiv},
  year = 2023,
}
@inproceedings(chen2023,
  title = "Accelerating {LLM} decoding with " # "speculative sampling",
  booktitle = acl,
  url = {https://arxiv.org/abs/2302.01318v2},
)
@misc{datacite,
  title = {A paper known by its {DataCite} {DOI}},
  doi = {10.48550/arXiv.2401.01234},
}
@book{knuth, title = {The {\TeX}book}, publisher = {Addison-Wesley}}
"""


def test_bibtex_entries_titles_abstracts_and_arxiv_ids(tmp_path):
    path = tmp_path / "library.bib"
    path.write_text(BIB)
    papers = read_library(path)
    assert [p.arxiv_id for p in papers] == ["2211.17192", "2302.01318", "2401.01234", None]
    assert papers[0].title == "Fast Inference from Transformers via Speculative Decoding"
    assert papers[0].abstract.startswith("Inference from large autoregressive models is slow")
    assert "draft models" in papers[0].abstract
    assert papers[1].title == "Accelerating LLM decoding with speculative sampling"
    assert papers[3].title == "The TeXbook"
    fields = parse_bibtex(BIB)
    assert [f["ID"] for f in fields] == ["leviathan2023", "chen2023", "datacite", "knuth"]
    assert fields[0]["year"] == "2023" and fields[1]["booktitle"] == "acl"


def test_bibtex_accents_stay_in_their_words(tmp_path):
    """Found from outside: `S{\\"a}tze` was read as "S atze" and `r{\\'e}sum{\\'e}` as
    "r esum e", words TF-IDF then never matched; `$\\alpha$` was "$ $"."""
    path = tmp_path / "library.bib"
    path.write_text(
        r"""@article{godel,
  title = {{\"U}ber formal unentscheidbare S{\"a}tze der {Principia} Mathematica},
  abstract = {Na{\"\i}ve r{\'e}sum{\'e} of {\c c}a, $\alpha$-stable, {\em emphasised} Erd\H{o}s},
}
"""
    )
    (paper,) = read_library(path)
    assert paper.title == "Über formal unentscheidbare Sätze der Principia Mathematica"
    assert paper.abstract == "Naïve résumé of ça, α-stable, emphasised Erdős"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "@article{a,\n title = {Unclosed {brace},\n}\n",
            "library.bib:1: @article entry is not closed",
        ),
        (
            "@article{a, title = {A}}\n\n@article{b,\n title {B}}\n",
            "library.bib:3: @article{b: expected",
        ),
        ('@article{a, title = "open quote}\n', "library.bib:1: a quoted field value is not closed"),
        ("@article{a, title = }\n", "library.bib:1: a field has no value"),
        ("just text, no entries\n", "library.bib: no entries with a title"),
    ],
)
def test_a_broken_bibtex_file_names_the_line_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "library.bib"
    path.write_text(text)
    with pytest.raises(BadInputFile) as caught:
        read_library(path)
    assert str(caught.value).startswith(str(tmp_path / problem)), str(caught.value)


def test_a_large_library_is_read_in_linear_time():
    """Found from outside: each entry counted its line from the top of the file, so a 6,000-
    entry Zotero export (9.6 MB) took 13 s and 20,000 entries after a long comment 22 s; a
    library of MAX_ENTRIES would have taken most of an hour. The lines stay right."""
    head = "% notes\n" * 200_000
    text = head + "".join(f"@misc{{k{i}, title = {{T{i}}}}}\n" for i in range(20_000))
    started = time.perf_counter()
    entries = parse_bibtex(text)
    assert len(entries) == 20_000 and entries[-1]["title"] == "T19999"
    assert time.perf_counter() - started < 3.0  # 0.2 s here; 22 s before
    with pytest.raises(BadInputFile, match=r":200004: @misc entry is not closed"):
        parse_bibtex(head + "@misc{a, title={A}}\n@misc{b, title={B}}\n\n@misc{c, title={C}\n")


def test_binary_and_missing_library_files(tmp_path):
    binary = tmp_path / "library.bib"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(BadInputFile, match="binary file"):
        read_library(binary)
    with pytest.raises(BadInputFile, match="cannot read"):
        read_library(tmp_path / "missing.bib")
    with pytest.raises(BadInputFile, match="a directory"):
        read_library(tmp_path)


def test_csl_json_as_zotero_exports_it(tmp_path):
    items = [
        {
            "type": "article",
            "title": "Medusa: Simple LLM Inference Acceleration",
            "abstract": "Extra decoding heads.",
            "URL": "http://arxiv.org/abs/2401.10774v3",
            "number": "arXiv:2401.10774",
        },
        {"type": "book", "title": "Speech and Language Processing"},
        {"type": "note"},  # no title: not a paper to learn from
    ]
    path = tmp_path / "zotero.json"
    path.write_text(json.dumps(items))
    papers = read_library(path)
    assert [(p.title, p.arxiv_id) for p in papers] == [
        ("Medusa: Simple LLM Inference Acceleration", "2401.10774"),
        ("Speech and Language Processing", None),
    ]
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(BadInputFile, match="not a CSL JSON export"):
        read_library(path)
    path.write_text("[1, ")
    with pytest.raises(BadInputFile):
        read_library(path)


def test_profile_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "profile.json"
    profile = ReaderProfile()
    profile.add_keywords(["speculative decoding", "Speculative  Decoding", "KV cache"])
    profile.add_authors(["Tri Dao"])
    assert profile.tag("liked", [TaggedPaper("A", "x", "2401.00001")]) == 1
    assert profile.tag("liked", [TaggedPaper("A, v2", "y", "2401.00001")]) == 0  # replaced
    save_profile(path, profile)
    again = load_profile(path)
    assert again.keywords == ["speculative decoding", "KV cache"]
    assert again.tags["liked"] == [TaggedPaper("A, v2", "y", "2401.00001")]
    with pytest.raises(ProfileError, match="the profile has no keyword 'nope'"):
        again.remove(["nope"], [], [])
    path.write_text('{"version": 1, "keywords": "not a list"}')
    with pytest.raises(ProfileError, match="keywords must be a list of strings"):
        load_profile(path)
    path.write_text('{"keywords": []}')
    with pytest.raises(ProfileError, match="not a Nightshift reader profile"):
        load_profile(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match=r"profile .*profile.json"):
        load_profile(path)


def _store_with_paper(db_url: str) -> None:
    engine = open_database(db_url)
    migrate.upgrade(engine)
    paper = Paper("2603.00007", "Liked Paper on KV Caches", "Paged attention, evicted blocks.")
    DigestStore(engine).upsert_papers([paper])


def test_the_profile_command_adds_shows_and_refuses_bad_input(tmp_path, db_url):
    runner = CliRunner()
    path = tmp_path / "profile.json"
    library = tmp_path / "library.bib"
    library.write_text(BIB)
    _store_with_paper(db_url)
    common = ["--profile", str(path)]
    added = runner.invoke(
        app,
        ["digest", "profile", "add", *common, "--keyword", "speculative decoding",
         "--author", "Tri Dao", "--library", str(library), "--like", "arXiv:2603.00007v2",
         "--db", db_url],
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    assert "4 new of 4 paper(s) under tag 'library'" in added.output
    shown = runner.invoke(app, ["digest", "profile", "show", *common])
    assert "keywords: speculative decoding" in shown.output
    assert "tag liked: 1 paper(s)" in shown.output
    assert "2603.00007  Liked Paper on KV Caches" in shown.output
    before = path.read_bytes()

    def refused(*args: str) -> str:
        result = runner.invoke(app, ["digest", "profile", *args, *common])
        assert result.exit_code == 2, result.output
        assert path.read_bytes() == before  # a refused change changes nothing
        return result.output

    out = refused("add", "--keyword", "new one", "--like", "2603.99999", "--db", db_url)
    assert "--like 2603.99999: no such paper in the digest store" in out
    assert "not an arXiv identifier" in refused("add", "--like", "banana", "--db", db_url)
    broken = tmp_path / "broken.bib"
    broken.write_text("@article{x,\n title = {no end\n")
    assert "broken.bib:1: @article entry is not closed" in refused(
        "add", "--keyword", "k", "--library", str(broken)
    )
    assert "the profile has no author 'Nobody'" in refused("remove", "--author", "Nobody")
    assert "the profile has no tag 'nope'" in refused("remove", "--tag", "nope")
    assert "nothing to add" in refused("add")
    # An empty --tag is refused like a blank one (it used to mean the default tag).
    for empty in ("", "  "):
        out = refused("add", "--tag", empty, "--like", "2603.00007", "--db", db_url)
        assert "a tag name cannot be empty" in out
        assert "a tag name cannot be empty" in refused(
            "add", "--tag", empty, "--library", str(library)
        )
    missing_db = f"sqlite:///{tmp_path / 'no-such.db'}"
    out = refused("add", "--like", "2603.00007", "--db", missing_db)
    assert "--like needs the digest store: no database file at" in out
    assert not (tmp_path / "no-such.db").exists()

    removed = runner.invoke(app, ["digest", "profile", "remove", *common, "--tag", "library"])
    assert removed.exit_code == 0, removed.output
    assert set(load_profile(path).tags) == {"liked"}


def test_a_profile_that_cannot_be_written_is_one_line(tmp_path):
    """Found from outside: `--profile` under a file (or on a read-only file system) ended
    `profile add` with a FileExistsError traceback and exit 1."""
    parent = tmp_path / "not-a-folder"
    parent.write_text("a file\n")
    path = parent / "profile.json"
    with pytest.raises(ProfileError, match="cannot write profile .*not-a-folder"):
        save_profile(path, ReaderProfile(keywords=["x"]))
    result = CliRunner().invoke(
        app, ["digest", "profile", "add", "--profile", str(path), "--keyword", "x"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: cannot write profile ") and "Traceback" not in (
        result.output
    )
    assert parent.read_text() == "a file\n"


def test_digest_run_refuses_a_missing_or_broken_profile(tmp_path, sqlite_url):
    runner = CliRunner()
    base = ["digest", "run", "--source", "examples/papers-2026-03-sample.jsonl", "--db"]
    base += [sqlite_url, "--out", str(tmp_path / "out"), "--endpoint", "http://127.0.0.1:9/v1"]
    base += ["--model", "m"]
    missing = runner.invoke(app, [*base, "--profile", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "none.json: no such file" in missing.output
    folder = runner.invoke(app, [*base, "--profile", str(tmp_path)])
    assert folder.exit_code == 2 and "is a directory, not a profile file" in folder.output
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    broken = runner.invoke(app, [*base, "--profile", str(bad)])
    assert broken.exit_code == 2 and "not a Nightshift reader profile" in broken.output
