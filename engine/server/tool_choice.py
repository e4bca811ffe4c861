"""How a chat answer's text becomes content and tool calls, by tool_choice.

"required" and a named function are enforced by structured output: `forced_constraint` builds a
JSON schema over the tools' parameter schemas (required: an array of one or more
{"name": <a tool's name>, "parameters": <its schema>} objects, or one such object when
parallel_tool_calls is false; named: that function's parameters alone), so the answer is
well-formed calls whatever the model. "auto" reads calls out of free text with the model
family's parser (tool_parsers/).

Each reader is fed the answer's text deltas and returns pieces: content text, or CallDelta
(a call's first delta carries its name, later ones only argument fragments), the order in which
OpenAI streams them. A whole answer is the same reader fed everything at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.server.tool_parsers import ToolCall, ToolParser
from engine.server.tool_parsers.base import json_value_end

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int
    name: str | None  # set on the call's first delta only
    arguments: str


Piece = str | CallDelta


def forced_constraint(tools: list[dict], choice: str | dict, parallel: bool) -> dict | None:
    """The `structured` constraint for tool_choice "required" or a named function, else None.
    tools: OpenAI's tool objects ({"type": "function", "function": {...}})."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(choice, dict):
        return {"json": functions[choice["function"]["name"]].get("parameters") or EMPTY_PARAMETERS}
    if choice != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "parameters": f.get("parameters") or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, f in functions.items()
    ]
    one = items[0] if len(items) == 1 else {"anyOf": items}
    if not parallel:
        return {"json": one}
    return {"json": {"type": "array", "items": one, "minItems": 1}}


class PlainText:
    """tool_choice "none" or no tools: everything is content."""

    num_calls = 0

    def feed(self, delta: str) -> list[Piece]:
        return [delta] if delta else []

    def finish(self) -> list[Piece]:
        return []


class NamedCall:
    """A named function: the whole answer is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, delta: str) -> list[Piece]:
        pieces: list[Piece] = []
        if self.num_calls == 0:
            self.num_calls = 1
            pieces.append(CallDelta(0, self.name, ""))
        if delta:
            pieces.append(CallDelta(0, None, delta))
        return pieces

    def finish(self) -> list[Piece]:
        return self.feed("")[:1] if self.num_calls == 0 else []


# The head of one call in the constrained answer (after the previous call's closing brace), up
# to the first character of its parameters (the lookahead keeps the separator's space out of the
# arguments while the value is still unwritten).
_CALL_HEAD = re.compile(
    r'(?:\s*\})?\s*[\[,]?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(?=[{\[])'
)


class RequiredCalls:
    """tool_choice "required": the grammar's [{"name": ..., "parameters": {...}}, ...] (or one
    object), read as it grows; each call's arguments stream as the model writes them."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where the next call's head may begin
        self._args: int | None = None  # where the open call's parameters begin
        self._sent = 0  # how far its arguments were handed out
        self.num_calls = 0

    def feed(self, delta: str) -> list[Piece]:
        self._text += delta
        pieces: list[Piece] = []
        while True:
            if self._args is None:
                head = _CALL_HEAD.match(self._text, self._pos)
                if head is None:
                    return pieces
                pieces.append(CallDelta(self.num_calls, json.loads(head.group(1)), ""))
                self._args = self._sent = head.end()
                self.num_calls += 1
            end = json_value_end(self._text, self._args)
            stop = len(self._text) if end is None else end
            if stop > self._sent:
                pieces.append(CallDelta(self.num_calls - 1, None, self._text[self._sent : stop]))
                self._sent = stop
            if end is None:
                return pieces
            self._pos, self._args = end, None

    def finish(self) -> list[Piece]:
        return []


class AutoCalls:
    """tool_choice "auto": the family's parser finds calls in free text; each complete call is
    handed out as its name, then its arguments. parallel_tool_calls false keeps the first."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self._parser = parser
        self._parallel = parallel
        self.num_calls = 0

    def feed(self, delta: str) -> list[Piece]:
        return self._pieces(self._parser.feed(delta))

    def finish(self) -> list[Piece]:
        return self._pieces(self._parser.finish())

    def _pieces(self, events: list) -> list[Piece]:
        pieces: list[Piece] = []
        for e in events:
            if not isinstance(e, ToolCall):
                pieces.append(e)
            elif self._parallel or self.num_calls == 0:
                pieces += [
                    CallDelta(self.num_calls, e.name, ""),
                    CallDelta(self.num_calls, None, e.arguments),
                ]
                self.num_calls += 1
        return pieces


def collect(pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls from its pieces."""
    content = "".join(p for p in pieces if isinstance(p, str))
    names: list[str] = []
    args: list[str] = []
    for p in pieces:
        if isinstance(p, CallDelta):
            if p.name is not None:
                names.append(p.name)
                args.append("")
            args[p.index] += p.arguments
    return content, [ToolCall(n, a) for n, a in zip(names, args)]
