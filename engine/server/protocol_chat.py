"""The chat completions request body: messages (text or content parts, tool calls and tool
results), tools and tool_choice (and the legacy functions / function_call), the chat template's
own fields, the chat API's names for sampling fields, and the shared ones from
protocol.SamplingRequest.

Every field is honoured or refused with a 400 naming it (OpenAI's `param` spelling, such as
`messages[2].content` or `tools[0].function.parameters`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from engine.sampling_params import SamplingParams
from engine.server.protocol import SamplingRequest
from engine.server.tool_choice import forced_constraint
from engine.structured.grammar import parse_spec

# Content parts a text-only model cannot take; any other type but "text" is unknown.
_MEDIA_PARTS = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file")
# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# apply_chat_template's own arguments: chat_template_kwargs may not set them behind the
# request's back (each has its own field).
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
    }
)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # OpenAI's roles (it refuses others; vLLM passes any to the template).
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers
    function_call: dict | None = None  # assistant, legacy: one call

    def text(self, i: int) -> str:
        """The message's text; media and unknown content parts are refused, and so is a
        missing or empty content where OpenAI requires one."""
        where = f"messages[{i}].content"
        if self.content is None:
            calls = self.tool_calls or self.function_call
            if self.role != "assistant" or not calls:
                raise InvalidRequestError(
                    f"{where}: a {self.role} message needs content"
                    + (" (or tool_calls)" if self.role == "assistant" else ""),
                    where,
                )
            return ""
        if not isinstance(self.content, list):
            return self.content
        if not self.content:
            raise InvalidRequestError(
                f"{where}: an empty array; give a string or at least one content part", where
            )
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind in _MEDIA_PARTS:
                raise InvalidRequestError(
                    f"{where}[{j}]: this model takes text only; {kind!r} content parts cannot be "
                    "given to it",
                    where,
                )
            if kind not in ("text", "input_text"):
                raise InvalidRequestError(
                    f"{where}[{j}]: unknown content part type {kind!r}; this model takes "
                    "'text' parts",
                    where,
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}[{j}]: a text part needs a string 'text'", where)
            texts.append(part["text"])
        return "".join(texts)

    def for_template(self, i: int) -> dict:
        """The message as chat templates read it (vLLM's shape: tool call arguments as a dict,
        since templates write them with tojson)."""
        out: dict = {"role": self.role, "content": self.text(i)}
        if self.name is not None:
            out["name"] = self.name
        calls = self.tool_calls
        if self.function_call is not None:  # legacy: one call, no id
            if calls:
                raise InvalidRequestError(
                    f"messages[{i}]: give tool_calls or function_call, not both",
                    f"messages[{i}].function_call",
                )
            calls = [{"id": "", "type": "function", "function": self.function_call}]
        if calls:
            if self.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}]: only assistant messages carry tool calls",
                    f"messages[{i}].tool_calls",
                )
            out["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(calls)]
        if self.role == "tool":
            if not self.tool_call_id:
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message needs the tool_call_id it answers",
                    f"messages[{i}].tool_call_id",
                )
            out["tool_call_id"] = self.tool_call_id
        if self.role == "function":  # legacy tool result: named by its function, no id
            out["role"] = "tool"
        return out


def _template_call(i: int, j: int, call: dict) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}: a tool call needs function.name", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):  # as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(
                f"{where}.function.arguments is not valid JSON: {e}", f"{where}.function.arguments"
            ) from None
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the schema is enforced where a call is forced, strict or not


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """The request's tools, resolved: OpenAI's tool objects (for the template), the choice
    ("none", "auto", "required" or {"type": "function", "function": {"name": ...}}), whether
    several calls may come, and whether the caller spoke the legacy functions API (answered
    with message.function_call)."""

    tools: list[dict] | None
    choice: str | dict
    parallel: bool
    legacy: bool

    @property
    def named(self) -> str | None:
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = Field(default=None, min_length=1)  # OpenAI: [] is refused
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = Field(default=None, min_length=1)
    function_call: str | dict | None = None
    # The chat template's fields (vLLM's names).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None

    def template_messages(self) -> list[dict]:
        messages = [m.for_template(i) for i, m in enumerate(self.messages)]
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true: "
                    "set add_generation_prompt to false to continue the last message",
                    "continue_final_message",
                )
            if messages[-1]["role"] != "assistant":
                raise InvalidRequestError(
                    "continue_final_message continues the last message, which must be an "
                    f"assistant message, not {messages[-1]['role']!r}",
                    "continue_final_message",
                )
        return messages

    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: each has its own field",
                "chat_template_kwargs",
            )
        return kwargs

    def tool_setup(self) -> ToolSetup:
        """Tools and tool_choice checked as OpenAI checks them; legacy functions mapped."""
        if self.functions is not None or self.function_call is not None:
            return self._legacy_setup()
        if self.tool_choice is not None and not self.tools:
            raise InvalidRequestError(
                "tool_choice is only allowed when tools are specified", "tool_choice"
            )
        if not self.tools:
            return ToolSetup(None, "none", True, False)
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        _check_functions([t["function"] for t in tools], "tools[{}].function")
        choice = _choice(self.tool_choice, tools, "tool_choice")
        return ToolSetup(tools, choice, self.parallel_tool_calls is not False, False)

    def _legacy_setup(self) -> ToolSetup:
        if self.tools or self.tool_choice is not None:
            raise InvalidRequestError(
                "give tools and tool_choice, or the legacy functions and function_call, not both",
                "functions",
            )
        if not self.functions:
            raise InvalidRequestError(
                "function_call is only allowed when functions are specified", "function_call"
            )
        functions = [f.model_dump(exclude_none=True) for f in self.functions]
        _check_functions(functions, "functions[{}]")
        tools = [{"type": "function", "function": f} for f in functions]
        call = self.function_call
        if isinstance(call, dict):
            call = {"type": "function", "function": {"name": call.get("name")}}
        # The legacy API returns at most one call (message.function_call).
        return ToolSetup(tools, _choice(call, tools, "function_call"), False, True)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs is only allowed when logprobs is true", "top_logprobs"
            )
        newer = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if newer else self.max_tokens
        try:
            return self.sampling_params(
                max_tokens, (self.top_logprobs or 0) if self.logprobs else None
            )
        except InvalidSamplingParamsError as e:
            # Errors name the chat API's fields, not the engine's.
            e.param = {
                "logprobs": "top_logprobs",
                "max_tokens": "max_completion_tokens" if newer else "max_tokens",
            }.get(e.param, e.param)
            raise

    def structured_output(self) -> dict | None:
        """The caller's constraint, or the one that forces tool calls ("required" or a named
        function); both at once cannot be honoured."""
        given = super().structured_output()
        setup = self.tool_setup()
        if setup.tools is None or setup.choice in ("none", "auto"):
            return given
        if given is not None:
            raise InvalidRequestError(
                f"tool_choice {_choice_text(setup.choice)} already constrains the answer to "
                "tool calls; leave out response_format and the structured-output fields",
                "tool_choice",
            )
        field = "functions" if setup.legacy else "tools"
        for i, tool in enumerate(setup.tools):
            parameters = tool["function"].get("parameters")
            if parameters is not None:
                try:
                    parse_spec({"json": parameters})
                except InvalidRequestError as e:
                    where = f"{field}[{i}]" + ("" if setup.legacy else ".function") + ".parameters"
                    raise InvalidRequestError(f"{where}: {e}", where) from None
        spec = forced_constraint(setup.tools, setup.choice, setup.parallel)
        parse_spec(spec)
        return spec


def _check_functions(functions: list[dict], where: str) -> None:
    seen = set()
    for i, f in enumerate(functions):
        name = f["name"]
        if not _FUNCTION_NAME.match(name):
            raise InvalidRequestError(
                f"{where.format(i)}.name: {name!r} must be 1 to 64 letters, digits, '_' or '-'",
                f"{where.format(i)}.name",
            )
        if name in seen:
            raise InvalidRequestError(
                f"{where.format(i)}.name: {name!r} is given twice", f"{where.format(i)}.name"
            )
        seen.add(name)
        parameters = f.get("parameters")
        if parameters is not None and parameters.get("type", "object") != "object":
            raise InvalidRequestError(
                f"{where.format(i)}.parameters: must be a JSON schema of type 'object'",
                f"{where.format(i)}.parameters",
            )


def _choice(choice: str | dict | None, tools: list[dict], field: str) -> str | dict:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required") or (
            choice == "required" and field == "function_call"
        ):
            allowed = "none, auto" + (", required" if field == "tool_choice" else "")
            raise InvalidRequestError(
                f"{field} must be one of {allowed} or a named function, got {choice!r}", field
            )
        return choice
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError(
            f'{field} must name a function as {{"type": "function", "function": {{"name": ...}}}}',
            field,
        )
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise InvalidRequestError(
            f"{field} names the function {name!r}, which is not among the tools "
            f"({', '.join(names)})",
            field,
        )
    return {"type": "function", "function": {"name": name}}


def _choice_text(choice: str | dict) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice['function']['name']!r}"
