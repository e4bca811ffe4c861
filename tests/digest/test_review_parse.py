"""parse_review: exact replies, each repair, each failure; and the response_format schema."""

from __future__ import annotations

import json

import pytest

from digest.review import Review, repeats_title
from digest.review_parse import parse_review, review_response_format
from tests.digest.fault_server import INVALID_REVIEW, default_responder, review_for

GOOD = {
    "summary": "The authors' method prunes attention heads.",
    "strengths": ["Simple method", "Fast inference"],
    "weaknesses": ["Few baselines"],
    "questions": ["Does it scale?"],
    "limitations": ["English only"],
    "soundness": 3,
    "presentation": None,
    "contribution": 2,
    "overall": 7,
    "confidence": 4,
    "decision": "Accept",
    "input_basis": "abstract",
}
EXPECTED = Review(**GOOD)


def _with(**changes) -> dict:
    return GOOD | changes


def test_exact_json_is_ok():
    result = parse_review(json.dumps(GOOD, indent=2), "abstract")
    assert (result.status, result.review, result.error) == ("ok", EXPECTED, None)


def test_input_basis_is_the_callers_and_may_be_missing():
    lying = parse_review(json.dumps(_with(input_basis="abstract")), "fulltext")
    assert lying.status == "ok" and lying.review.input_basis == "fulltext"
    missing = {k: v for k, v in GOOD.items() if k != "input_basis"}
    assert parse_review(json.dumps(missing), "abstract") == parse_review(
        json.dumps(GOOD), "abstract"
    )


JSON = json.dumps(GOOD)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # fences and prose around the object
        (f"Here is my review:\n```json\n{JSON}\n```\nHope this helps!", EXPECTED),
        # a brace in the prose before the object
        (f"Scores use {{1..10}}. Review: {JSON}", EXPECTED),
        # trailing commas
        (JSON.replace('"English only"]', '"English only",]').replace("}", ",\n}"), EXPECTED),
        # Python's repr: single quotes, None, and an apostrophe inside a double-quoted string
        (repr(GOOD), EXPECTED),
        # Python literals in otherwise JSON text
        (JSON.replace("null", "None"), EXPECTED),
        # single quotes around a string that holds an apostrophe
        (
            JSON.replace('"Does it scale?"', "'Does the model's speedup scale?'"),
            Review(**_with(questions=["Does the model's speedup scale?"])),
        ),
        # a raw newline inside a string
        (
            JSON.replace("prunes attention", "prunes\nattention"),
            Review(**_with(summary="The authors' method prunes\nattention heads.")),
        ),
        # cut off by max_tokens: inside the last string, after a comma, before the last brace
        (JSON[: JSON.index('"abstract"') + 4], EXPECTED),
        (JSON[: JSON.index('"input_basis"')], EXPECTED),
        (JSON[: JSON.index('"input_basis"') + 5], EXPECTED),
        (JSON[:-1], EXPECTED),
        # a string where a list belongs
        (
            json.dumps(_with(weaknesses="Few baselines", limitations="")),
            Review(**_with(weaknesses=["Few baselines"], limitations=[])),
        ),
        # numeric strings and fractions on the field's own scale
        (
            json.dumps(_with(overall="7/10", soundness="3/4", confidence=" 4 ", contribution="2")),
            EXPECTED,
        ),
        # valid JSON that only a lax reading accepts is a repair, not ok
        (json.dumps(_with(contribution="2")), EXPECTED),
    ],
    ids=[
        "fences",
        "brace-in-prose",
        "trailing-commas",
        "python-repr",
        "python-literals",
        "apostrophe",
        "raw-newline",
        "cut-in-string",
        "cut-after-comma",
        "cut-in-key",
        "cut-before-brace",
        "string-for-list",
        "numeric-strings",
        "integer-string",
    ],
)
def test_repairs(text, expected):
    result = parse_review(text, "abstract")
    assert (result.status, result.error) == ("repaired", None)
    assert result.review == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            json.dumps({k: v for k, v in GOOD.items() if k != "overall"}),
            "invalid review: overall: Field required",
        ),
        (
            json.dumps(_with(overall=11)),
            "invalid review: overall: Input should be less than or equal to 10",
        ),
        (
            json.dumps(_with(soundness=0, confidence=6)),
            "invalid review: soundness: Input should be greater than or equal to 1; "
            "confidence: Input should be less than or equal to 5",
        ),
        (  # a fraction on another scale is not converted
            json.dumps(_with(soundness="3/10")),
            "invalid review: soundness: Input should be a valid integer, "
            "unable to parse string as an integer",
        ),
        (  # cut off inside the lists: the rest is missing, not invented
            JSON[: JSON.index('"Few baselines"')],
            "invalid review: questions: Field required; limitations: Field required; "
            "overall: Field required; confidence: Field required; decision: Field required",
        ),
        (INVALID_REVIEW, "no JSON object in the reply"),
        ("", "no JSON object in the reply"),
    ],
    ids=[
        "missing",
        "out-of-range",
        "two-out-of-range",
        "other-scale",
        "truncated",
        "prose",
        "empty",
    ],
)
def test_failures(text, error):
    result = parse_review(text, "abstract")
    assert (result.status, result.review, result.error) == ("failed", None, error)


def test_unparsable_object_fails_with_the_json_error():
    result = parse_review("{summary: great paper, overall = 7}", "abstract")
    assert result.status == "failed" and result.review is None
    assert result.error.startswith("no parsable JSON object in the reply (Expecting")


def test_response_format_is_strict_and_matches_review():
    fmt = review_response_format()
    assert fmt["type"] == "json_schema"
    spec = fmt["json_schema"]
    assert (spec["name"], spec["strict"]) == ("paper_review", True)
    schema = spec["schema"]
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    asked = [name for name in GOOD if name != "decision"]  # the score decides
    assert schema["required"] == asked == [n for n in Review.model_fields if n != "decision"]
    assert all("default" not in prop for prop in schema["properties"].values())
    overall = schema["properties"]["overall"]
    assert (overall["type"], overall["minimum"], overall["maximum"]) == ("integer", 1, 10)
    assert "decision" not in schema["properties"]
    assert {"type": "null"} in schema["properties"]["soundness"]["anyOf"]
    assert Review.model_json_schema()["required"] != schema["required"]  # the model is untouched


def test_the_stub_review_parses_ok():
    body = {"messages": [{"role": "user", "content": "Title: Tiny Models\nAnswer in JSON."}]}
    result = parse_review(default_responder(body), "abstract")
    assert result.status == "ok"
    assert result.review == Review(**review_for("Tiny Models"))


def test_the_decision_follows_the_score_not_the_model():
    # Issue 19: all 23 reviews said "Accept", 17 of them under a score of 4/10 or less.
    low = parse_review(json.dumps(_with(overall=3, decision="Accept")), "abstract")
    assert low.status == "ok" and low.review.decision == "Reject"
    six = parse_review(json.dumps(_with(overall=6, decision="Reject")), "abstract")
    assert six.review.decision == "Accept"
    unasked = {k: v for k, v in GOOD.items() if k != "decision"}
    assert parse_review(json.dumps(unasked), "abstract") == parse_review(JSON, "abstract")
    any_case = parse_review(json.dumps(_with(decision=" REJECT ")), "abstract")
    assert any_case.review == EXPECTED


def test_junk_list_items_are_dropped_and_repeats_kept_once():
    # Issue 19's junk: numbers, punctuation, one-word scraps; a looping list says one thing 4x.
    junk = ["1.00", "4.], ,", "N/A", "2.", "Clear motivation", " clear  motivation "]
    result = parse_review(json.dumps(_with(strengths=junk, limitations=["-", ""])), "abstract")
    assert result.status == "ok"
    assert result.review.strengths == ["Clear motivation"]
    assert result.review.limitations == []


def test_a_summary_cut_by_the_length_bound_ends_at_a_sentence_or_a_whole_word():
    cut = "The paper shows X. It then argues that the evaluation of large langu"
    assert parse_review(json.dumps(_with(summary=cut)), "abstract").review.summary == (
        "The paper shows X."
    )
    one = "It argues that the evaluation of large langu"
    assert parse_review(json.dumps(_with(summary=one)), "abstract").review.summary == (
        "It argues that the evaluation of large…"
    )


def test_latex_commands_keep_their_backslash():
    # The model copies `\textbf{...}` from the abstract into a JSON string without doubling
    # the backslash; JSON reads a tab and "extbf" (issue 19), or a backspace for `\beta`.
    reply = JSON.replace(
        "prunes attention heads.", "prunes \\textbf{heads}, $\\beta$ and $\\nabla f$ twice."
    ).replace("\\\\", "\\")
    assert "\\textbf" in reply and "\\\\textbf" not in reply
    summary = parse_review(reply, "abstract").review.summary
    assert summary == "The authors' method prunes \\textbf{heads}, $\\beta$ and $\\nabla f$ twice."
    # A real newline escape before ordinary text is left alone; so is an escaped backslash.
    kept = JSON.replace("attention heads.", "heads.\\nThe end.").replace(
        "Few baselines", "Uses \\\\textbf markup"
    )
    review = parse_review(kept, "abstract").review
    assert review.summary.endswith("heads. The end.")
    assert review.weaknesses == ["Uses \\textbf markup"]


def test_the_bounds_sent_hold_items_to_phrases():
    import re

    props = review_response_format()["json_schema"]["schema"]["properties"]
    item = props["strengths"]["items"]
    assert props["strengths"]["minItems"] == 1 and props["strengths"]["maxItems"] == 4
    pattern = re.compile(item["pattern"])
    assert pattern.match("Clear motivation") and pattern.match("LLM evaluation is thorough")
    for junk in ("1.00", "4.], ,", "N/A", "Simple", "weaknesses i"):
        assert not pattern.match(junk)
    assert props["summary"]["maxLength"] == 400 and "pattern" not in props["summary"]


def test_an_item_written_into_every_list_counts_once():
    same = ["Comedy drama sketches"]
    reply = _with(strengths=same, weaknesses=same + ["Few baselines"], questions=same)
    review = parse_review(json.dumps(reply), "abstract").review
    assert review.strengths == same and review.weaknesses == ["Few baselines"]
    assert review.questions == []


def test_items_that_label_or_loop_are_dropped():
    """Seen on the default model over 50 real papers (prompt 2026-12-05.5): items that are a
    list's name with filler, and items that say one thing three times."""
    labels = ["strengths ia", "weaknesses are", "questions of current tokenizers"]
    loop = "What is the best way to use XMTC? " * 3
    recital = "strengths is a list of 1 to 4 items that are lists of 1 to 4 items that are lists"
    kept = ["Limited baselines", "Questionable evaluation protocol"]
    reply = _with(strengths=[*labels, loop.strip(), recital], weaknesses=kept)
    review = parse_review(json.dumps(reply), "abstract").review
    assert review.strengths == []
    # A list's name inside an item, or another word opening it, is fine.
    assert review.weaknesses == ["Limited baselines", "Questionable evaluation protocol"]


COMIC = "COMIC: Agentic Sketch Comedy Generation"


@pytest.mark.parametrize(
    ("summary", "title", "expected"),
    [
        (
            "COMIC: Agentic Sketch Comedy Generation",
            "COMIC: Agentic Sketch Comedy Generation",
            True,
        ),
        ("Comic: Agentic Sketch Comedy…", "COMIC: Agentic Sketch Comedy Generation", True),
        (
            "COMIC: Agentic Sketch Comedy Generation.",
            "COMIC: Agentic Sketch Comedy Generation",
            True,
        ),
        ("The paper proposes COMIC, an agentic system.", "COMIC: Agentic Sketch Comedy", False),
        (
            "COMIC: Agentic Sketch Comedy Generation shows that agents can write sketches.",
            "COMIC: Agentic Sketch Comedy Generation",
            False,
        ),
        ("Tiny", "Tiny Models", False),
    ],
)
def test_a_reviewer_summary_that_is_the_title(summary, title, expected):
    assert repeats_title(summary, title) is expected
