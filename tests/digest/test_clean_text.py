"""Characters XML 1.0 cannot carry (C0 controls, NUL, U+FFFE/U+FFFF, lone surrogates) in a paper's
metadata or a model's reply: the feed still parses, and PostgreSQL (no NUL in text) stores it."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from digest.clean_text import xml_safe
from digest.pipeline import run_digest
from digest.prompts import REVIEW_TASK, SUMMARY_TASK
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from tests.digest.fault_server import Fault, FaultServer, review_for
from tests.digest.test_pipeline import DAY, options

BAD = "\x00\x01\x08\x0b\x0c\x1f\ufffe\uffff\ud800"


def test_xml_safe_keeps_everything_xml_can_carry():
    assert xml_safe(f"a{BAD}b") == "ab"
    kept = "tab\there\nnew\rline é ∑ 𝔸 \x7f \ufffd <&>"
    assert xml_safe(kept) == kept


def _papers(path):
    records = [
        {
            "id": "2603.00001v1",
            "title": "Control\x01 characters and a non-character \ufffe in a title",
            "abstract": "An abstract with a NUL\x00 byte and a form feed\x0c.",
            "authors": ["Ada\x00 Lovelace", "Alan Turing"],
            "categories": ["cs.CL"],
        },
        {
            "id": "2603.00002v1",
            "title": "A clean title",
            "abstract": "A clean abstract.",
            "authors": ["Grace Hopper"],
            "categories": ["cs.CL"],
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_characters_reach_neither_the_store_nor_the_outputs(tmp_path, db_url):
    run = options(tmp_path, db_url, "", source=str(_papers(tmp_path / "bad.jsonl")))
    # The model may emit them too: raw in a summary, JSON-escaped inside a review.
    review = review_for("A clean title") | {"strengths": ["Good\u0000 and \u0001 odd"]}
    faults = [
        Fault("text", match=SUMMARY_TASK[:40], text="A summary\x01 with \x00 a NUL.", times=1),
        Fault("text", match=REVIEW_TASK[:40], text=json.dumps(review), times=-1),
    ]
    with FaultServer(faults=faults) as stub:
        run.endpoint = stub.base_url
        report = run_digest(run)
    assert (report.status, report.papers_done) == ("succeeded", 2), report.failed

    digest = DigestStore(open_database(db_url)).load_digest(DAY)
    first = digest.entries[0]
    assert first.paper.title == "Control characters and a non-character  in a title"
    assert first.paper.abstract == "An abstract with a NUL byte and a form feed ."
    assert first.paper.authors == ["Ada Lovelace", "Alan Turing"]
    texts = [e.summary for e in digest.entries] + [s for e in digest.entries for s in
                                                    e.review.strengths]  # fmt: skip
    assert all(xml_safe(t) == t for t in texts), texts
    # The characters go; the review's list items are also normalized to single spaces.
    assert "Good and odd" in texts
    assert "A summary with a NUL." in texts  # the faults above hit: the model's own text

    out = tmp_path / "out"
    feed = ET.parse(out / "feed.xml").getroot()  # raises on any illegal character
    assert len(feed.findall("{http://www.w3.org/2005/Atom}entry")) == 1
    for page in out.glob("digest-*"):
        assert xml_safe(page.read_text()) == page.read_text(), page.name
