"""The structured review a model writes for a paper: the schema (pydantic, validated) that is both
sent as `response_format` and used to check the reply."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from digest.clean_text import xml_safe

InputBasis = Literal["abstract", "fulltext"]
ParseStatus = Literal["ok", "repaired", "failed"]


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

    @field_validator("summary", "strengths", "weaknesses", "questions", "limitations")
    @classmethod
    def _xml_safe(cls, value: str | list[str]) -> str | list[str]:
        # A JSON escape (\u0000) in the reply brings back what the client cleaned from its text.
        return xml_safe(value) if isinstance(value, str) else [xml_safe(v) for v in value]


# The decision follows the score (NeurIPS: 6 is "weak accept"); asking the model for both let
# the default model write "Accept" under a 3/10 (17 of 23 reviews, issue 19).
ACCEPT_MIN_OVERALL = 6

# A list item is a phrase: at least two words of letters, and mostly letters. "1.00", "4.], ,"
# and "N/A" are not (64% of the default model's items were such junk, issue 19).
ITEM_MIN_WORDS = 2
_LETTER_WORD = re.compile(r"[^\W\d_]{2,}")


def decision_for(overall: int) -> Literal["Accept", "Reject"]:
    return "Accept" if overall >= ACCEPT_MIN_OVERALL else "Reject"


def is_phrase(item: str) -> bool:
    text = item.strip()
    if len(_LETTER_WORD.findall(text)) < ITEM_MIN_WORDS:
        return False
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * sum(not c.isspace() for c in text)
