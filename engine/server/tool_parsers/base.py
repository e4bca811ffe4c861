"""What every "auto" tool-call parser shares: one incremental scanner over the model's text that
hands out plain content and complete tool calls, configured per model family by the markers that
open a tool-call section and the shape of the JSON inside it.

The scanner is fed text deltas and returns only what can no longer change: it holds back a tail
that may be the start of a marker (`<tool_` may become `<tool_call>`) and trailing whitespace
(the layout before a call is not content). A non-streaming answer is the same scanner fed the
whole text at once, so streamed and whole answers agree. A section whose JSON does not parse as
calls goes back to the client as content, marker included: the model's text is never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


# What a parser hands out, in order: content text, or a complete call.
Event = str | ToolCall


def json_value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON object or array opening at text[start], or None while it
    is still open. Counts brackets outside strings; json.loads judges the value afterwards."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_from(value: object) -> ToolCall | None:
    """A call from {"name": ..., "arguments" | "parameters": {...}}; None for any other shape."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def calls_from(value: object) -> list[ToolCall] | None:
    """One call or a list of them; None unless every item is a call."""
    items = value if isinstance(value, list) else [value]
    calls = [call_from(v) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolParser:
    """Subclasses set the markers. starts: markers that open a section anywhere in the text;
    opens_output: characters that open a section when the output begins with them (after
    whitespace), for families whose call marker is a special token the detokenizer drops;
    end: the marker that closes a section, or None when a section is JSON values (several
    only where separator is set)."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]] = ()
    opens_output: ClassVar[str] = ""
    end: ClassVar[str | None] = None
    separator: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # everything before it has been handed out
        self._section: int | None = None  # where the open section's marker begins
        self._body = 0  # where the open section's JSON begins
        self._raw = 0  # where the section's text not yet handed out as calls begins
        self._after_call = False  # whitespace after a call is layout, not content
        self.num_calls = 0

    def feed(self, delta: str) -> list[Event]:
        self._text += delta
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        """Whatever is left once the output is complete (an open section becomes content unless
        its JSON is whole: models often end at EOS without the closing tag)."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            step = (
                self._section_step(final) if self._section is not None else self._text_step(final)
            )
            if step is None:
                return events
            events.extend(e for e in step if e)

    # -- content

    def _text_step(self, final: bool) -> list[Event] | None:
        text, pos = self._text, self._pos
        if self._after_call:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            self._pos = pos
            if pos == len(text):
                return None
        found = self._find_start(pos)
        if found is not None:
            at, marker = found
            before = text[pos:at].rstrip()
            # Malformed calls go back as content with the whitespace before them.
            self._section, self._raw = at, pos + len(before)
            self._body = self._pos = at + len(marker)
            if before:
                self._after_call = False
            return [before]
        if final:
            self._pos = len(text)
            rest = text[pos:]
            if rest:
                self._after_call = False
            return [rest] if rest else None
        safe = len(text) - self._held_back(pos)
        safe = pos + len(text[pos:safe].rstrip())
        if safe <= pos:
            return None
        self._pos, self._after_call = safe, False
        return [text[pos:safe]]

    def _find_start(self, pos: int) -> tuple[int, str] | None:
        text = self._text
        hits = [(i, m) for m in self.starts if (i := text.find(m, pos)) >= 0]
        if pos == 0 and self.opens_output:
            first = len(text) - len(text.lstrip())
            head = text[first:]
            # `[TOOL_CALLS]` opens with `[` too: the marker wins, and a head that may still
            # become it waits.
            maybe_marker = any(m.startswith(head) or head.startswith(m) for m in self.starts)
            if head and head[0] in self.opens_output and not maybe_marker:
                return first, ""
        return min(hits) if hits else None

    def _held_back(self, pos: int) -> int:
        """How many trailing characters may still become a marker."""
        text = self._text
        if pos == 0 and self.opens_output and not text.strip():
            return len(text)  # the output may yet open with a call
        held = 0
        for marker in self.starts:
            for k in range(min(len(marker) - 1, len(text) - pos), held, -1):
                if marker.startswith(text[len(text) - k :]):
                    held = k
                    break
        return held

    # -- a tool-call section

    def _section_step(self, final: bool) -> list[Event] | None:
        if self.end is not None:
            return self._tagged_step(final)
        return self._json_step(final)

    def _tagged_step(self, final: bool) -> list[Event] | None:
        text = self._text
        close = text.find(self.end, self._body)
        if close < 0 and not final:
            return None
        stop = len(text) if close < 0 else close + len(self.end)
        body = text[self._body : len(text) if close < 0 else close].strip()
        try:
            calls = calls_from(json.loads(body))
        except json.JSONDecodeError:
            calls = None
        return self._close_section(stop, calls)

    def _json_step(self, final: bool) -> list[Event] | None:
        text = self._text
        start = self._pos
        while start < len(text) and text[start].isspace():
            start += 1
        read_one = self._pos > self._body  # this section already gave calls
        if start == len(text):
            if not final:
                return None
            return self._close_section(len(text), [] if read_one else None)
        if read_one:  # after a value: another one, or the section is over
            if self.separator is None or text[start] != self.separator:
                return self._close_section(self._pos, [])
            start += 1
            while start < len(text) and text[start].isspace():
                start += 1
            if start == len(text):
                return self._close_section(len(text), []) if final else None
        if text[start] not in "{[":
            return self._close_section(start, None)
        end = json_value_end(text, start)
        if end is None:
            return self._close_section(len(text), None) if final else None
        try:
            calls = calls_from(json.loads(text[start:end]))
        except json.JSONDecodeError:
            calls = None
        if calls is None:
            return self._close_section(end, None)
        self.num_calls += len(calls)
        self._pos = self._raw = end
        self._after_call = True
        if self.separator is None:
            self._section = None
        return list(calls)

    def _close_section(self, stop: int, calls: list[ToolCall] | None) -> list[Event]:
        """End the open section at stop: its calls, or (None) its raw text as content."""
        raw = self._text[self._raw : stop]
        self._section, self._pos = None, stop
        if calls is None:
            self._after_call = False
            return [raw]
        if calls:
            self.num_calls += len(calls)
            self._after_call = True
        return list(calls)
