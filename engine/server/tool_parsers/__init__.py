"""Tool-call parsers for tool_choice "auto", one per model family, by --tool-call-parser name
or detected from the chat template's text (the markers the template teaches the model)."""

from __future__ import annotations

from engine.server.tool_parsers.base import Event, ToolCall, ToolParser
from engine.server.tool_parsers.hermes import HermesToolParser
from engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.server.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["PARSERS", "Event", "ToolCall", "ToolParser", "detect_parser", "parser_class"]


def parser_class(name: str) -> type[ToolParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        ) from None


def detect_parser(template: str | None) -> str | None:
    """The parser a chat template's markers call for, or None when it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    # Llama 3.1 writes calls after <|python_tag|>; 3.2's templates only describe the
    # {"name": ..., "parameters": ...} shape inside their header-tagged turns.
    if "<|python_tag|>" in template or (
        "<|start_header_id|>" in template and "parameters" in template
    ):
        return "llama3_json"
    return None
