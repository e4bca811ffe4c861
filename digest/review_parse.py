"""Turns a model's review reply into a validated Review.

A reply that is exactly valid JSON and validates is "ok". A reply with the usual slips is
"repaired": prose or code fences around the object, trailing commas, Python's True/False/None and
single quotes, an end cut off by max_tokens, a string where a list belongs, "7/10" for 7, "accept"
for "Accept". Whatever would need a guess (a missing field, a score out of range) is "failed": the
caller keeps the raw text instead. `input_basis` always comes from the caller, who knows it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import ValidationError

from digest.review import LIST_MAX_ITEMS, InputBasis, ParseStatus, Review

_LIST_FIELDS = ("strengths", "weaknesses", "questions", "limitations")
_SCORE_SCALES = {
    "soundness": 4,
    "presentation": 4,
    "contribution": 4,
    "overall": 10,
    "confidence": 5,
}
_SCORE_RE = re.compile(r"\s*(\d+)\s*(?:/\s*(\d+)\s*)?")
_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PY_LITERALS = {"True": "true", "False": "false", "None": "null"}
_AFTER_STRING = ",:}]"  # what may follow a closing quote in an object or array
# A key with no value at the cut-off end of an object: `, "key"` or `{"key":`.
_DANGLING_KEY_RE = re.compile(r'([{,])\s*"(?:[^"\\]|\\.)*"\s*:?\s*$')
_MAX_CANDIDATES = 8  # '{' positions tried before giving up on finding the object


@dataclass(slots=True)
class ReviewParse:
    review: Review | None
    status: ParseStatus
    error: str | None = None


def review_response_format() -> dict:
    """OpenAI's `response_format` for a Review, in the strict form structured outputs require.
    The decision is not asked: it follows from the overall score (Review)."""
    schema = Review.model_json_schema()
    schema["properties"].pop("decision")
    # Strict mode wants every property required (nullable ones via anyOf null) and no extras.
    schema["required"] = list(schema["properties"])
    schema["additionalProperties"] = False
    for name, prop in schema["properties"].items():
        prop.pop("default", None)
        _bound(name, prop)
    return {
        "type": "json_schema",
        "json_schema": {"name": "paper_review", "schema": schema, "strict": True},
    }


# Bounds sent with the schema: a small model held to a grammar can otherwise loop inside a string
# or a list until max_tokens cuts the JSON off (with the length bounds, 19 of 20 greedy reviews
# closed properly, 2026-11-29), or fill a list with "1.00" and "4.], ," (issue 19: 64% of the
# items): an item must start with a word and have a second one. No minimum length and no
# pattern on the summary: where the model wants to stop, a grammar that forbids it makes it
# write filler ("weaknesses ia") or a full stop mid-word ("highly-sc."), seen on the default
# model. Review's validators check the items, and end a cut summary, on our side.
SUMMARY_MAX_CHARS = 400
ITEM_MAX_CHARS = 160
ITEM_PATTERN = r"^[A-Za-z][A-Za-z'-]* [A-Za-z]{2}[^\n]*$"


def _bound(name: str, prop: dict) -> None:
    if prop.get("type") == "array":
        prop["minItems"] = 1
        prop["maxItems"] = LIST_MAX_ITEMS
        prop.setdefault("items", {}).update(maxLength=ITEM_MAX_CHARS, pattern=ITEM_PATTERN)
    elif prop.get("type") == "string" and name == "summary":
        prop["maxLength"] = SUMMARY_MAX_CHARS


def parse_review(text: str, input_basis: InputBasis) -> ReviewParse:
    text = keep_latex_backslashes(text)
    exact = _validate_exact(text, input_basis)
    if exact is not None:
        return ReviewParse(exact, "ok")
    data, error = _find_object(text)
    if data is None:
        return ReviewParse(None, "failed", error)
    _coerce(data, input_basis)
    try:
        return ReviewParse(Review.model_validate(data), "repaired")
    except ValidationError as e:
        return ReviewParse(None, "failed", _condense(e))


# A LaTeX command the model copied from the abstract into a JSON string without doubling its
# backslash: JSON reads `\textbf` as a tab and "extbf", `\beta` as a backspace and "eta" (then
# cleaned away as a control character). A JSON escape \t \b \f \r followed by a lower-case
# letter, or \n followed by a LaTeX command's name, is taken as the command (issue 19).
_LATEX_ESCAPE = re.compile(
    r"(?<!\\)((?:\\\\)*)\\(?=[bfrt][a-z]|n(?:abla|eq|ewline|oindent|ot|u|e|i)(?![a-z]))"
)


def keep_latex_backslashes(text: str) -> str:
    return _LATEX_ESCAPE.sub(lambda m: m.group(1) + "\\\\", text)


def _validate_exact(text: str, input_basis: InputBasis) -> Review | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    data["input_basis"] = input_basis
    try:  # strict: a "3" for 3 is a repair, not ok
        return Review.model_validate(data, strict=True)
    except ValidationError:
        return None


def _find_object(text: str) -> tuple[dict | None, str]:
    """The first '{' that starts a (repairable) JSON object, parsed; else None and why."""
    starts = [m.start() for m in re.finditer(r"\{", text)][:_MAX_CANDIDATES]
    if not starts:
        return None, "no JSON object in the reply"
    first_error = ""
    for start in starts:
        try:
            data = json.loads(_repair(text, start), strict=False)  # raw newlines in strings too
        except json.JSONDecodeError as e:
            first_error = first_error or f"no parsable JSON object in the reply ({e})"
            continue
        if isinstance(data, dict):
            return data, ""
    return None, first_error


def _repair(text: str, start: int) -> str:
    """JSON text for the object opening at `start`: stops at its balanced end, and closes it
    when the text ends first; quotes, Python literals and trailing commas are normalized."""
    out: list[str] = []
    closers: list[str] = []
    i = start
    while i < len(text):
        c = text[i]
        if c in "\"'":
            token, i = _read_string(text, i)
            out.append(token)
            continue
        if c.isascii() and (c.isalpha() or c == "_"):
            word = _WORD_RE.match(text, i).group()
            out.append(_PY_LITERALS.get(word, word))
            i += len(word)
            continue
        if c in "}]":
            _drop_trailing_comma(out)
            if closers and closers[-1] == c:
                closers.pop()
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
        out.append(c)
        i += 1
        if not closers:
            return "".join(out)
    return _close(out, closers)


def _read_string(text: str, i: int) -> tuple[str, int]:
    """A quoted string at text[i] as a JSON string, and the index after it. A quote closes the
    string only when what follows fits after a string; otherwise it is part of the text (an
    apostrophe in 'the model's', a stray " in a summary). A string cut off by the end is closed."""
    quote = text[i]
    body: list[str] = []
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 == len(text):
                break  # a lone backslash at the cut-off end
            nxt = text[i + 1]
            body.append("'" if nxt == "'" else c + nxt)  # \' is not a JSON escape
            i += 2
            continue
        if c == quote and _closes_string(text, i + 1):
            return '"' + "".join(body) + '"', i + 1
        body.append('\\"' if c == '"' else c)
        i += 1
    return '"' + "".join(body) + '"', i


def _closes_string(text: str, after: int) -> bool:
    rest = text[after:].lstrip()
    return not rest or rest[0] in _AFTER_STRING


def _drop_trailing_comma(out: list[str]) -> None:
    joined = "".join(out).rstrip()
    out[:] = [joined[:-1] if joined.endswith(",") else joined]


def _close(out: list[str], closers: list[str]) -> str:
    """Closes an object/array cut off by max_tokens: a dangling key or comma goes first."""
    joined = "".join(out).rstrip()
    if closers and closers[-1] == "}":
        joined = _DANGLING_KEY_RE.sub(lambda m: "{" if m.group(1) == "{" else "", joined)
    joined = joined.rstrip().removesuffix(",")
    return joined + "".join(reversed(closers))


def _coerce(data: dict, input_basis: InputBasis) -> None:
    """The repairs that need no guess; anything else is left for validation to reject."""
    for name in _LIST_FIELDS:
        value = data.get(name)
        if isinstance(value, str):
            data[name] = [value] if value.strip() else []
    for name, scale in _SCORE_SCALES.items():
        value = data.get(name)
        match = _SCORE_RE.fullmatch(value) if isinstance(value, str) else None
        # "3/4" is 3 on a 4-point scale; "3/10" for a 4-point score is left alone (invalid).
        if match and (match.group(2) is None or int(match.group(2)) == scale):
            data[name] = int(match.group(1))
    decision = data.get("decision")
    if isinstance(decision, str) and decision.strip().capitalize() in ("Accept", "Reject"):
        data["decision"] = decision.strip().capitalize()
    data["input_basis"] = input_basis


def _condense(error: ValidationError) -> str:
    parts = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "review"
        parts.append(f"{where}: {e['msg']}")
    return "invalid review: " + "; ".join(parts)
