"""Llama 3.1 / 3.2 JSON calls: the answer is `{"name": ..., "parameters": {...}}` (several
separated by `;`), optionally after `<|python_tag|>`. That tag is a special token, which the
detokenizer drops, so an output that opens with `{` is read as calls too (as vLLM's
llama3_json parser does); a JSON answer that is not a call stays content."""

from __future__ import annotations

from engine.server.tool_parsers.base import ToolParser


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    starts = ("<|python_tag|>",)
    opens_output = "{"
    separator = ";"
