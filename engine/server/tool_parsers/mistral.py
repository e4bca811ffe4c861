"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]` is a
special token in most Mistral tokenizers and the detokenizer drops it, so an output that opens
with `[` is read as calls too; a JSON array that is not calls stays content."""

from __future__ import annotations

from engine.server.tool_parsers.base import ToolParser


class MistralToolParser(ToolParser):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    opens_output = "["
