"""Request bodies of the OpenAI API: the sampling fields chat and completions share, and the
completions body (chat's is in protocol_chat.py); unknown fields are ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidStructuredOutputError
from engine.sampling_params import SamplingParams
from engine.structured.grammar import parse_spec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json": {"type": "object"}}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidStructuredOutputError(
                "response_format: json_schema.schema is required for type json_schema",
                "response_format",
            )
        return {"json": self.json_schema.schema_}


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    # Structured output: OpenAI's response_format, or vLLM's guided_* fields (one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured=self.structured_output(),
        )

    def structured_output(self) -> dict | None:
        """The engine's `structured` constraint; an error names the field it came from."""
        given = {
            name: spec
            for name, spec in (
                ("response_format", self.response_format and self.response_format.structured()),
                ("guided_json", _tagged("json", self.guided_json)),
                ("guided_regex", _tagged("regex", self.guided_regex)),
                ("guided_choice", _tagged("choice", self.guided_choice)),
            )
            if spec is not None
        }
        if len(given) > 1:
            raise InvalidStructuredOutputError(
                f"give only one of {', '.join(given)}", next(iter(given))
            )
        if not given:
            return None
        ((name, spec),) = given.items()
        try:
            parse_spec(spec)
        except InvalidStructuredOutputError as e:
            raise InvalidStructuredOutputError(f"{name}: {e}", name) from None
        return spec


def _tagged(kind: str, value: object) -> dict | None:
    return None if value is None else {kind: value}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(
            16 if self.max_tokens is None else self.max_tokens, self.logprobs
        )

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)
