"""The structured review a model writes for a paper: the schema (pydantic, validated) that is both
sent as `response_format` and used to check the reply."""

from __future__ import annotations

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
