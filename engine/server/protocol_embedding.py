"""The /v1/embeddings request body (OpenAI's, with vLLM's extra fields add_special_tokens and
normalize); unknown fields are accepted and named in the log. `input` is checked here, by hand,
so that every refusal names `input` (a pydantic union would name one of its branches)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.server.errors import APIError
from engine.server.protocol import OpenAIBaseModel

_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class EmbeddingRequest(OpenAIBaseModel):
    is_body = True
    model: str | None = None  # None: the served model
    # Any here, checked in inputs(): a wrong shape is refused naming `input`, not a union branch.
    input: Any = Field(description=f"The text(s) or token ids to embed: {_SHAPES}.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # keep the first d values, then normalize again
    user: str | None = None  # OpenAI's end-user id; accepted, not used
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens (BOS) around text
    normalize: bool = True  # vLLM: L2-normalize the pooled vector
    truncate_prompt_tokens: int | None = None  # vLLM: keep each input's last k tokens (-1: all)
    priority: int = Field(
        default=0, ge=-(2**63), le=2**63 - 1, strict=True
    )  # vLLM: lower runs first

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a non-empty string or a non-empty list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [_text(value, "input")]
        if not isinstance(value, list):
            raise _bad(f"input must be {_SHAPES}")
        if not value:
            raise _bad("input must not be empty: give at least one string or token id list")
        if all(_is_token(t) for t in value):
            return [list(value)]
        if all(isinstance(v, str) for v in value):
            return [_text(v, f"input[{i}]") for i, v in enumerate(value)]
        if all(isinstance(v, list) for v in value):
            return [_tokens(v, f"input[{i}]") for i, v in enumerate(value)]
        raise _bad(f"input must be {_SHAPES}")


def _text(value: str, where: str) -> str:
    if not value:
        raise _bad(f"{where} is an empty string: there is nothing to embed", where)
    return value


def _tokens(value: list, where: str) -> list[int]:
    if not value:
        raise _bad(f"{where} is an empty list of token ids: there is nothing to embed", where)
    if not all(_is_token(t) for t in value):
        raise _bad(
            f"{where} must be a list of token ids (integers); input must be {_SHAPES}", where
        )
    return list(value)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(message: str, where: str = "input") -> APIError:
    return APIError(400, message, param=where)
