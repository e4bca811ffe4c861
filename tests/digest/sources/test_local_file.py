from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from digest.sources.local_file import BadPapersFile, load_papers_file
from digest.sources.polite_http import SourceError

FIXTURES = Path(__file__).parent / "fixtures"
JSON_FIXTURE = FIXTURES / "papers_cs_2026-03_m3.json"


def record(arxiv_id: str, **fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "id": arxiv_id,
        "title": f"Paper {arxiv_id}",
        "abstract": f"About {arxiv_id}.",
        "authors": ["A. Author"],
        "categories": ["cs.CL"],
    }
    base.update(fields)
    return base


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_json_list_as_in_the_shared_data():
    papers = load_papers_file(JSON_FIXTURE, None)
    assert [(p.arxiv_id, p.version) for p in papers] == [
        ("2603.11048", 1),
        ("2603.11039", 1),
        ("2603.11027", 1),
    ]
    comic = papers[0]
    assert comic.title == "COMIC: Agentic Sketch Comedy Generation"
    # The file repeats the primary category at the end; it stays first, once.
    assert comic.categories == ["cs.CV", "cs.AI", "cs.CL", "cs.MA", "cs.NE"]
    assert comic.authors == [
        "Susung Hong",
        "Brian Curless",
        "Ira Kemelmacher-Shlizerman",
        "Steve Seitz",
    ]
    assert comic.abstract.startswith("We propose a fully automated AI system")
    assert comic.published is None and comic.announce_type is None


def test_json_object_with_a_papers_list_and_max_papers(tmp_path):
    document = {"papers": [record("2603.00001"), record("2603.00002"), record("2603.00003")]}
    path = write(tmp_path / "day.json", json.dumps(document))
    assert [p.arxiv_id for p in load_papers_file(path, 2)] == ["2603.00001", "2603.00002"]


def test_jsonl_with_string_fields_versions_and_times(tmp_path):
    lines = [
        record(
            "2603.00001v1",
            authors="Ann Lee, Bo Chen ,",
            categories="cs.LG cs.CL,cs.AI",
            published="2026-03-10T12:30:00Z",
        ),
        record("math/0211159", title="An\n  old   title", published="2002-11-11"),
        record("2603.00001v3", updated="2026-03-12T08:00:00+02:00"),
    ]
    text = "\n".join(json.dumps(line) for line in lines) + "\n\n"
    first, old = load_papers_file(write(tmp_path / "day.jsonl", text), None)
    assert (first.arxiv_id, first.version) == ("2603.00001", 3)
    assert first.updated == datetime(2026, 3, 12, 6, 0, tzinfo=UTC)
    assert (old.arxiv_id, old.version, old.title) == ("math/0211159", 1, "An old title")
    assert old.published == datetime(2002, 11, 11, tzinfo=UTC)
    [v1] = load_papers_file(write(tmp_path / "one.jsonl", json.dumps(lines[0])), None)
    assert v1.authors == ["Ann Lee", "Bo Chen"]
    assert v1.categories == ["cs.LG", "cs.CL", "cs.AI"]
    assert v1.published == datetime(2026, 3, 10, 12, 30, tzinfo=UTC)


def test_atom_file_takes_every_paper_whatever_its_date(tmp_path):
    path = tmp_path / "saved.atom"
    shutil.copy(FIXTURES / "arxiv_api_legacy_format_cs.RO_m2.atom.xml", path)
    papers = load_papers_file(path, None)
    assert [p.arxiv_id for p in papers] == ["2510.14968", "2510.14827"]
    assert load_papers_file(FIXTURES / "arxiv_api_current_m5.atom.xml", 1)[0].version == 1


def test_a_file_without_a_known_suffix_is_sniffed(tmp_path):
    atom = (FIXTURES / "arxiv_api_legacy_format_cs.RO_m2.atom.xml").read_text(encoding="utf-8")
    assert len(load_papers_file(write(tmp_path / "saved.txt", atom), None)) == 2
    plain = write(tmp_path / "papers.data", json.dumps([record("2603.00009")]))
    assert [p.arxiv_id for p in load_papers_file(plain, None)] == ["2603.00009"]


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(SourceError, match=rf"^{path}: cannot read \(No such file or directory\)$"):
        load_papers_file(path, None)


def test_invalid_json_names_the_line(tmp_path):
    path = write(tmp_path / "bad.json", '[\n  {"id": "2603.00001",\n  "title": }\n]')
    with pytest.raises(SourceError) as caught:
        load_papers_file(path, None)
    assert str(caught.value) == f"{path}:3: not JSON: Expecting value (column 12)"


def test_invalid_jsonl_names_the_line(tmp_path):
    text = json.dumps(record("2603.00001")) + "\n{broken\n"
    path = write(tmp_path / "bad.jsonl", text)
    with pytest.raises(SourceError, match=rf"^{path}:2: not JSON: "):
        load_papers_file(path, None)


def test_missing_field_names_the_entry_and_field(tmp_path):
    entries = [record("2603.00001"), record("2603.00002")]
    del entries[1]["abstract"]
    path = write(tmp_path / "day.json", json.dumps(entries))
    with pytest.raises(SourceError) as caught:
        load_papers_file(path, None)
    assert str(caught.value) == f"{path}: entry 2 has no 'abstract'"


def test_missing_field_in_jsonl_names_the_line(tmp_path):
    lines = [record("2603.00001"), record("2603.00002")]
    del lines[1]["categories"]
    path = write(tmp_path / "day.jsonl", "\n".join(json.dumps(line) for line in lines))
    with pytest.raises(SourceError) as caught:
        load_papers_file(path, None)
    assert str(caught.value) == f"{path}: line 2 has no 'categories'"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"id": "not-an-id"}, "entry 1: not an arXiv identifier: 'not-an-id'"),
        ({"id": 2603.00001}, "entry 1: 'id' must be a string"),
        ({"authors": [1, 2]}, "entry 1: 'authors' must be a list of strings or a string"),
        ({"published": "yesterday"}, "entry 1: 'published' is not an ISO 8601 time: 'yesterday'"),
    ],
)
def test_bad_values_are_named(tmp_path, bad, message):
    path = write(tmp_path / "day.json", json.dumps([record("2603.00001", **bad)]))
    with pytest.raises(SourceError) as caught:
        load_papers_file(path, None)
    assert str(caught.value) == f"{path}: {message}"


def test_json_that_is_not_a_list_of_papers(tmp_path):
    path = write(tmp_path / "day.json", json.dumps({"items": []}))
    with pytest.raises(SourceError, match="expected a list of papers or an object with a 'papers'"):
        load_papers_file(path, None)
    path = write(tmp_path / "day2.json", json.dumps(["2603.00001"]))
    with pytest.raises(SourceError, match=r"entry 1 is not an object$"):
        load_papers_file(path, None)


def test_malformed_atom_file(tmp_path):
    path = write(tmp_path / "saved.xml", '<?xml version="1.0"?><feed><title>x</titel></feed>')
    with pytest.raises(SourceError, match=rf"^{path}: malformed feed"):
        load_papers_file(path, None)


def test_a_partly_readable_atom_file_is_refused_not_half_taken(tmp_path):
    """An entity-expansion bomb: the parser refuses the entities, and recovering the entry
    anyway would store a paper titled "&lol9;" over the real one."""
    entities = "".join(f'<!ENTITY lol{n} "{f"&lol{n - 1};" * 10}">' for n in range(2, 10))
    path = write(
        tmp_path / "bomb.xml",
        f'<?xml version="1.0"?><!DOCTYPE feed [<!ENTITY lol1 "lol">{entities}]>'
        '<feed xmlns="http://www.w3.org/2005/Atom"><entry>'
        "<id>http://arxiv.org/abs/2603.00001v1</id><title>&lol9;</title>"
        "<summary>An abstract.</summary><published>2026-03-09T00:00:00Z</published>"
        '<author><name>A B</name></author><category term="cs.CL"/></entry></feed>',
    )
    with pytest.raises(SourceError, match=rf"^{path}: malformed feed"):
        load_papers_file(path, None)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000, "not JSON we read: nested too deeply"),
        ("big.jsonl", '{"id": ' + "9" * 5000 + "}\n", "not JSON we read: an integer of 5000"),
        ("empty.jsonl", "", "no papers in the file"),
        ("empty.json", "  \n", "no papers in the file"),
        ("none.json", "[]", "no papers in the file"),
        ("nan.json", '[{"id": NaN}]', "entry 1 has no 'title'"),
        ("binary.jsonl", "\x00\x01", "a NUL byte: a binary file?"),
    ],
)
def test_files_the_workload_readers_refuse_are_one_bad_file_error(tmp_path, name, content, message):
    path = write(tmp_path / name, content)
    with pytest.raises(BadPapersFile) as caught:
        load_papers_file(path, None)
    assert message in str(caught.value) and str(caught.value).startswith(str(path))


def test_a_directory_is_a_bad_file(tmp_path):
    with pytest.raises(BadPapersFile, match="cannot read"):
        load_papers_file(tmp_path, None)
