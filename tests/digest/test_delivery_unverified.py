"""What the email, the webhook and the feed carry, tried from outside (issue 19): a summary the
faithfulness check flags is marked "unverified" there as on the page (readers of the email or
the feed never see the page's mark), and authors' LaTeX (`G\\"odel`) is shown as text."""

from __future__ import annotations

import json
from xml.etree import ElementTree

from digest.delivery.message import email_message, slack_payload
from digest.pipeline import run_digest
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, options

ATOM = "{http://www.w3.org/2005/Atom}"


def test_email_webhook_and_feed_mark_an_unverified_summary(tmp_path, sqlite_url):
    papers = tmp_path / "boastful.jsonl"
    papers.write_text(
        "".join(
            json.dumps(
                {"id": f"2603.0000{n}v1", "title": title, "authors": ['Kurt G\\"odel'],
                 "abstract": f"We study {title.lower()} on two datasets.", "categories": ["cs.CL"]}
            ) + "\n"
            for n, title in enumerate(["Honest Paper", "Boastful Paper"], 1)
        )
    )  # fmt: skip
    faults = [Fault("text", text="It beats GPT-5 by 40 points.", match="Boastful", times=1)]
    with FaultServer(faults=faults) as stub:
        run_digest(options(tmp_path, sqlite_url, stub.base_url, source=str(papers)))
    digest = DigestStore(open_database(sqlite_url)).load_digest(DAY)

    message = email_message(digest, "d@example.org", ["r@example.org"], None)
    text = message.get_body(("plain",)).get_content()
    html = message.get_body(("html",)).get_content()
    assert text.count("unverified: it names GPT-5, 40") == 1
    assert html.count("Unverified:") == 1 and "It names GPT-5, 40" in html
    for part in (text, html):
        assert "Kurt Gödel" in part and "G\\" not in part

    slack = slack_payload(digest, None)["text"]
    assert slack.count("_Unverified:_ It beats GPT-5 by 40 points.") == 1

    feed = ElementTree.parse(tmp_path / "out" / "feed.xml").getroot()
    (summary,) = [e.find(f"{ATOM}summary").text for e in feed.iter(f"{ATOM}entry")]
    assert summary.count("<strong>Unverified</strong> (it names GPT-5, 40") == 1
