"""A batch's input file checked whole before any line runs (OpenAI's contract): every line a JSON
object with a custom_id, method POST, the batch's url and a body that the endpoint would accept;
no custom_id twice; no more lines than the limit. Errors carry the 1-based line number, so one
bad line fails the batch with a list the caller can fix in one pass."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from engine.server.errors import field_path
from engine.server.protocol import CompletionRequest
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.protocol_embedding import EmbeddingRequest

MAX_REPORTED_ERRORS = 100  # enough to fix a file by; a file of bad lines is not echoed back
MAX_CUSTOM_ID_CHARS = 512
_BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int  # 1-based, in the input file
    custom_id: str
    body: dict


@dataclass(frozen=True, slots=True)
class LineError:
    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_json(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class ParsedInput:
    lines: list[BatchLine]
    errors: list[LineError]


def parse_input(data: bytes, endpoint: str, served_model: str, max_lines: int) -> ParsedInput:
    """The file's requests, or the errors that refuse it (both lists; the batch runs only when
    `errors` is empty). Blank lines are skipped, as a trailing newline is common."""
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    count = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        count += 1
        if len(errors) >= MAX_REPORTED_ERRORS:
            continue  # still counted, for the line limit
        parsed = _parse_line(raw, number, endpoint, served_model)
        if isinstance(parsed, LineError):
            errors.append(parsed)
            continue
        first = seen.setdefault(parsed.custom_id, number)
        if first != number:
            errors.append(
                LineError(
                    "duplicate_custom_id",
                    f"custom_id {parsed.custom_id!r} is also on line {first}; each request's "
                    "custom_id must be unique in the file",
                    number,
                    "custom_id",
                )
            )
            continue
        lines.append(parsed)
    if count == 0:
        errors.append(LineError("empty_file", "the input file holds no requests"))
    elif count > max_lines:
        errors.insert(
            0,
            LineError(
                "too_many_requests",
                f"the input file holds {count} requests, over this server's limit of "
                f"{max_lines} per batch (set by --batch-max-lines)",
            ),
        )
    return ParsedInput(lines, errors)


class _NotJson(ValueError):
    pass


def _no_constants(name: str) -> object:
    """Python's parser reads NaN and Infinity; JSON has neither. A line holding one would pass
    here and then fail as it is sent (a body with NaN cannot be encoded as JSON)."""
    raise _NotJson(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    """1e999 is JSON, but Python reads it as infinity, which cannot be sent on as JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise _NotJson(f"the number {text[:40]} is out of range")
    return value


def _parse_line(raw: bytes, number: int, endpoint: str, served_model: str) -> BatchLine | LineError:
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constants, parse_float=_finite)
    except UnicodeDecodeError as e:
        return LineError("invalid_json_line", f"the line is not UTF-8 ({e.reason})", number)
    except json.JSONDecodeError as e:
        return LineError("invalid_json_line", f"the line is not valid JSON: {e.msg}", number)
    except _NotJson as e:
        return LineError("invalid_json_line", f"the line is not valid JSON: {e}", number)
    except (ValueError, RecursionError) as e:  # a 5000-digit number; nesting deeper than Python
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        return LineError("invalid_json_line", f"the line cannot be read: {reason}", number)
    if not isinstance(obj, dict):
        return LineError("invalid_json_line", "the line is not a JSON object", number)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _missing(number, "custom_id", "a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(
            "invalid_custom_id",
            f"custom_id has {len(custom_id)} characters, more than {MAX_CUSTOM_ID_CHARS}",
            number,
            "custom_id",
        )
    if obj.get("method") != "POST":
        return LineError(
            "invalid_method", f"method must be POST, got {obj.get('method')!r}", number, "method"
        )
    if obj.get("url") != endpoint:
        return LineError(
            "invalid_url",
            f"url {obj.get('url')!r} differs from the batch's endpoint {endpoint!r}; every line "
            "must call the batch's endpoint",
            number,
            "url",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return _missing(number, "body", "a JSON object (the request)")
    problem = _check_body(body, endpoint, served_model)
    if problem is not None:
        param, message = problem
        return LineError("invalid_request", message, number, param)
    return BatchLine(number, custom_id, body)


def _check_body(body: dict, endpoint: str, served_model: str) -> tuple[str, str] | None:
    """(param, message) when the endpoint would refuse the body on its own grounds."""
    try:
        request = _BODY_MODELS[endpoint].model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = field_path(("body", *first.get("loc", ())))
        return f"body.{where}" if where else "body", f"body.{where}: {first.get('msg')}"
    model = getattr(request, "model", None)
    if model is not None and model != served_model:
        return "body.model", (
            f"body.model {model!r} does not exist; this server serves {served_model!r}"
        )
    if getattr(request, "stream", False):
        return "body.stream", "body.stream: a batch line cannot stream; leave stream out"
    return None


def _missing(number: int, field: str, what: str) -> LineError:
    return LineError("missing_required_parameter", f"{field} must be {what}", number, field)
