"""Request bodies of the OpenAI API: the sampling fields chat and completions share, and the
completions body (chat's is in protocol_chat.py).

Every field is either honoured or refused with a 400 naming it; none is accepted and silently
dropped. Unknown fields are accepted (OpenAI's clients send new ones before servers know them)
and named in one warning line of the server log, as vLLM does. `user` is accepted and not used:
OpenAI documents it as an end-user id for abuse monitoring, which this server does not do (and
does not log, so that the logs hold no user identifiers)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import InvalidRequestError, InvalidStructuredOutputError
from engine.sampling_params import SamplingParams, generator_seed
from engine.server.errors import APIError
from engine.structured.grammar import parse_spec

logger = logging.getLogger(__name__)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class OpenAIBaseModel(BaseModel):
    """A request object that accepts unknown fields and names them in the log (vLLM's wording),
    so that a misspelt or unsupported option is visible to whoever runs the server. A request
    body (is_body) is also checked for text that is not Unicode."""

    model_config = ConfigDict(extra="allow")
    is_body: ClassVar[bool] = False

    @model_validator(mode="wrap")
    @classmethod
    def _log_unknown_fields(cls, data: Any, handler):
        if cls.is_body:
            check_unicode(data, "")
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = sorted(str(k) for k in data if k not in known)
            if unknown:
                logger.warning(
                    "The following fields were present in the request but ignored: %s",
                    set(unknown),
                )
        return result


def check_unicode(value: Any, path: str) -> None:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which Python keeps in a str but no
    tokenizer, grammar or encoder can take: refused here, naming where it is, rather than
    failing deep inside with a 500."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400,
                f"{path or 'the request'}: the text has a lone surrogate "
                f"(U+{ord(value[e.start]):04X} at character {e.start}), which is not a Unicode "
                "character; send the text as valid UTF-8",
                param=path or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


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


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = None  # a last chunk with the request's usage
    # vLLM's usage on every chunk: not implemented, so refused rather than ignored.
    continuous_usage_stats: bool | None = None


class StructuredOutputs(OpenAIBaseModel):
    """vLLM's structured_outputs: one constraint, in the engine's `structured` shape."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's tuning options: the engine's grammars have fixed settings, so setting one is refused.
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def structured(self) -> dict | None:
        for option in (
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
            "whitespace_pattern",
            "structural_tag",
        ):
            if getattr(self, option) not in (None, False):
                raise InvalidStructuredOutputError(
                    f"structured_outputs.{option} is not supported by this server",
                    "structured_outputs",
                )
        specs = [
            (name, spec)
            for name, spec in (
                ("json", _tagged("json", self.json_)),
                ("regex", _tagged("regex", self.regex)),
                ("choice", _tagged("choice", self.choice)),
                ("grammar", _tagged("grammar", self.grammar)),
                ("json_object", {"json": {"type": "object"}} if self.json_object else None),
            )
            if spec is not None
        ]
        if len(specs) > 1:
            raise InvalidStructuredOutputError(
                "structured_outputs: give only one kind of constraint, got "
                + ", ".join(name for name, _ in specs),
                "structured_outputs",
            )
        if not specs:
            raise InvalidStructuredOutputError(
                "structured_outputs: give one kind of constraint (json, regex, choice or "
                "json_object); none is specified",
                "structured_outputs",
            )
        return specs[0][1]


class SamplingRequest(OpenAIBaseModel):
    is_body = True
    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Any 64-bit integer (vLLM's range), mapped onto the engine's seeds deterministically.
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: token id (a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM: top-k logprobs of every prompt position
    return_token_ids: bool | None = None  # vLLM: token_ids and prompt_token_ids in the response
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last k tokens (-1: all)
    # vLLM: the scheduler takes waiting requests by (priority, arrival), lower first.
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX, strict=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used (see the module's docstring)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older
    # guided_* fields (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_fields(self) -> None:
        """Combinations of fields that cannot be honoured: a 400 naming the field."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options can only be given when stream is true", "stream_options"
            )
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequestError(
                "stream_options.continuous_usage_stats is not supported by this server",
                "stream_options",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.check_fields()
        if max_tokens == 0 and not self.prefill_only_allowed():
            raise InvalidRequestError(
                "max_tokens must be at least 1, got 0 (0 is only for echo in /v1/completions)",
                "max_tokens",
            )
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
            seed=None if self.seed is None else generator_seed(self.seed),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs(),
            structured=self.structured_output(),
            logit_bias=self.token_logit_bias(),
        )

    def prefill_only_allowed(self) -> bool:
        """Whether max_tokens 0 (score the prompt, generate nothing) makes sense here."""
        return False

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (ranges are checked by SamplingParams, and against
        the vocabulary by the server, which knows it)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            bias[token] = value
        return bias

    def structured_output(self) -> dict | None:
        """The engine's `structured` constraint; an error names the field it came from."""
        given = {
            name: spec
            for name, spec in (
                ("response_format", self.response_format and self.response_format.structured()),
                (
                    "structured_outputs",
                    self.structured_outputs and self.structured_outputs.structured(),
                ),
                ("guided_json", _tagged("json", self.guided_json)),
                ("guided_regex", _tagged("regex", self.guided_regex)),
                ("guided_choice", _tagged("choice", self.guided_choice)),
                ("guided_grammar", _tagged("grammar", self.guided_grammar)),
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
    # Refused unless they ask for nothing: no model here fills in a middle, and vLLM v1 has no
    # best_of (it equals n: each sample is its own best).
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of must equal n ({self.n}) or be left out, got {self.best_of}", "best_of"
            )
        return self.sampling_params(
            16 if self.max_tokens is None else self.max_tokens, self.logprobs
        )

    def prefill_only_allowed(self) -> bool:
        return self.echo

    def engine_prompt_logprobs(self) -> int | None:
        # echo with logprobs returns the prompt's logprobs too (OpenAI's legacy completions).
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)
