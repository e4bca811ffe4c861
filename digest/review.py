"""The structured review a model writes for a paper: the schema (pydantic, validated) that is both
sent as `response_format` and used to check the reply.

What the model writes is checked on our side too, whatever the server enforced (a cloud API may
ignore the bounds, a reply may come through the repair path): list items that are not phrases
(or are a list's name with filler, or loop) are dropped, a summary cut by a length bound ends at
a sentence or a whole word, and the decision is derived from the overall score rather than asked
(issue 19)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from digest.clean_text import xml_safe
from digest.repetition import loops
from digest.summary_text import finish_text, letters

InputBasis = Literal["abstract", "fulltext"]
ParseStatus = Literal["ok", "repaired", "failed"]

# The decision follows the score (NeurIPS: 6 is "weak accept"); asking the model for both let
# the default model write "Accept" under a 3/10 (17 of 23 reviews, issue 19).
ACCEPT_MIN_OVERALL = 6

# A list item is a phrase: at least two words of letters, and mostly letters. "1.00", "4.], ,"
# and "N/A" are not (64% of the default model's items were such junk, issue 19).
ITEM_MIN_WORDS = 2
LIST_MAX_ITEMS = 4
_LETTER_WORD = re.compile(r"[^\W\d_]{2,}")
_LIST_FIELDS = ("strengths", "weaknesses", "questions", "limitations")
# An item that opens with a list's name is the model labelling, not saying: "strengths ia",
# "weaknesses are", "questions of the dataset", "strengths is a list of 1 to 4 items" (on the
# default model, 41 of 191 items over 50 real papers, prompt 2026-12-05.5).
_LIST_NAME_FIRST = re.compile(r"^(?:strengths?|weakness(?:es)?|questions?|limitations?)\b", re.I)


def decision_for(overall: int) -> Literal["Accept", "Reject"]:
    return "Accept" if overall >= ACCEPT_MIN_OVERALL else "Reject"


def is_phrase(item: str) -> bool:
    text = item.strip()
    if len(_LETTER_WORD.findall(text)) < ITEM_MIN_WORDS:
        return False
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * sum(not c.isspace() for c in text)


def is_list_item(item: str) -> bool:
    """A phrase that says something: not a list's name with filler, and not a loop ("What is
    the best way? What is the best way? ...")."""
    text = item.strip()
    return is_phrase(text) and not _LIST_NAME_FIRST.match(text) and not loops(text)


def repeats_title(summary: str, title: str) -> bool:
    """Whether a reviewer's summary is the paper's title: whole, cut short ("Comic: Agentic
    Sketch Comedy…"), without its first word ("A Parallel Corpus ..." for "ViDia2Std: A
    Parallel Corpus ..."), or with a word or two added. The prompt opens with the title line
    and a small model copies it. Compared as letters and digits only."""
    said, titled = letters(summary), letters(title)
    if len(said) < 10 or not titled:
        return False
    if said in titled:
        return len(said) >= len(titled) / 2
    return titled in said and len(said) <= len(titled) + 16


class Review(BaseModel):
    """A conference-style review. The 1-4 sub-scores may be null when judged from an abstract."""

    model_config = ConfigDict(extra="ignore")

    summary: str
    strengths: list[str]
    weaknesses: list[str]
    questions: list[str]
    limitations: list[str]
    soundness: int | None = Field(default=None, ge=1, le=4)
    presentation: int | None = Field(default=None, ge=1, le=4)
    contribution: int | None = Field(default=None, ge=1, le=4)
    overall: int = Field(ge=1, le=10)
    confidence: int = Field(ge=1, le=5)
    decision: Literal["Accept", "Reject"]
    input_basis: InputBasis

    @model_validator(mode="before")
    @classmethod
    def _decision_from_score(cls, data: Any) -> Any:
        # Not asked of the model (the schema sent leaves it out); a stored review written when
        # it was asked shows the decision its score implies, too.
        if isinstance(data, dict) and type(data.get("overall")) is int:
            data = {**data, "decision": decision_for(data["overall"])}
        return data

    @field_validator("summary")
    @classmethod
    def _summary(cls, value: str) -> str:
        # A JSON escape (\u0000) in the reply brings back what the client cleaned from its text;
        # the schema's length bound may have cut the summary anywhere.
        return finish_text(xml_safe(value))

    @model_validator(mode="after")
    def _said_once(self) -> Review:
        # A looping model writes one item into every list ("Comedy-Drama" as strength,
        # weakness, question and limitation): it counts where it first appears.
        seen: set[str] = set()
        for name in _LIST_FIELDS:
            items = getattr(self, name)
            setattr(self, name, [i for i in items if i.lower() not in seen])
            seen.update(i.lower() for i in items)
        return self

    @field_validator(*_LIST_FIELDS)
    @classmethod
    def _phrases(cls, value: list[str]) -> list[str]:
        kept: list[str] = []
        for item in value:
            text = " ".join(xml_safe(item).split())
            if is_list_item(text) and text.lower() not in (k.lower() for k in kept):
                kept.append(text)
        return kept[:LIST_MAX_ITEMS]
