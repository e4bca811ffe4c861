"""parse_review: exact replies, each repair, each failure; and the response_format schema."""

from __future__ import annotations

import json

import pytest

from digest.review import Review
from digest.review_parse import parse_review, review_response_format
from tests.digest.fault_server import INVALID_REVIEW, default_responder, review_for

GOOD = {
    "summary": "The authors' method prunes attention heads.",
    "strengths": ["Simple", "Fast"],
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
        # decision in any case
        (json.dumps(_with(decision="accept")), EXPECTED),
        (json.dumps(_with(decision=" REJECT ")), Review(**_with(decision="Reject"))),
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
        "decision-lower",
        "decision-upper",
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
            json.dumps({k: v for k, v in GOOD.items() if k != "decision"}),
            "invalid review: decision: Field required",
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
        (
            json.dumps(_with(decision="Weak accept")),
            "invalid review: decision: Input should be 'Accept' or 'Reject'",
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
        "decision",
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
    assert schema["required"] == list(Review.model_fields) == list(GOOD)
    assert all("default" not in prop for prop in schema["properties"].values())
    overall = schema["properties"]["overall"]
    assert (overall["type"], overall["minimum"], overall["maximum"]) == ("integer", 1, 10)
    assert schema["properties"]["decision"]["enum"] == ["Accept", "Reject"]
    assert {"type": "null"} in schema["properties"]["soundness"]["anyOf"]
    assert Review.model_json_schema()["required"] != schema["required"]  # the model is untouched


def test_the_stub_review_parses_ok():
    body = {"messages": [{"role": "user", "content": "Title: Tiny Models\nAnswer in JSON."}]}
    result = parse_review(default_responder(body), "abstract")
    assert result.status == "ok"
    assert result.review == Review(**review_for("Tiny Models"))
