"""Hermes-style calls, as Qwen2.5 / Qwen3 and NousResearch Hermes templates ask for:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one call per tag."""

from __future__ import annotations

from engine.server.tool_parsers.base import ToolParser


class HermesToolParser(ToolParser):
    name = "hermes"
    starts = ("<tool_call>",)
    end = "</tool_call>"
