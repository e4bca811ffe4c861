"""From a request's constraint to a compiled grammar, once per (tokenizer, constraint).

A constraint is `{"json": schema}`, `{"regex": pattern}` or `{"choice": [strings]}`. `parse_spec`
checks its shape and turns it into a `GrammarSpec` whose text is canonical (a schema as compact
JSON; keys keep their order, because the order of `properties` is the order the output is written
in; objects that list their properties are closed to them, see closed_objects). llguidance
turns the spec into grammar text and validates it without a tokenizer, so a bad schema or regex is
rejected when `SamplingParams` is built, before the request reaches the engine.

`GrammarCompiler` holds one tokenizer's compiled matchers in an LRU keyed by the spec: the digest
sends the same review schema for every paper, and its grammar is compiled once; each request gets
a deep copy of the compiled matcher (microseconds), which then holds that request's own state.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from llguidance import LLMatcher, LLTokenizer
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidStructuredOutputError
from engine.structured.matcher import RequestMatcher

KINDS = ("json", "regex", "choice")
# JSON with fixed separators and no free whitespace. llguidance's default allows any whitespace
# between tokens, and a small model can then emit newlines forever instead of closing the object.
# ", " and ": " are how models write JSON anyway, so the constraint rarely has to steer them.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DEFAULT_CAPACITY = 128


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str  # canonical: the schema as compact JSON, the pattern, the choices as JSON


def parse_spec(structured: object) -> GrammarSpec:
    """The canonical spec of a `structured` constraint; raises InvalidStructuredOutputError naming
    the problem (wrong shape, a schema or regex that does not compile)."""
    if not isinstance(structured, dict) or len(structured) != 1:
        raise InvalidStructuredOutputError(
            f"structured must be a dict with exactly one of the keys {', '.join(KINDS)}, "
            f"got {_short(structured)}"
        )
    ((kind, value),) = structured.items()
    if kind == "json":
        spec = GrammarSpec(kind, _schema_text(value))
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidStructuredOutputError(f"regex must be a non-empty string, got {value!r}")
        spec = GrammarSpec(kind, value)
    elif kind == "choice":
        if not isinstance(value, list | tuple) or not value:
            raise InvalidStructuredOutputError(
                f"choice must be a non-empty list of strings, got {_short(value)}"
            )
        if not all(isinstance(c, str) for c in value):
            raise InvalidStructuredOutputError(f"choice must hold only strings, got {value!r}")
        spec = GrammarSpec(kind, json.dumps(list(value)))
    else:
        raise InvalidStructuredOutputError(
            f"unknown structured output kind {kind!r}; use one of {', '.join(KINDS)}"
        )
    grammar_text(spec)  # compiles (cached) or raises
    return spec


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidStructuredOutputError(f"json schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise InvalidStructuredOutputError(
            f"json schema must be a JSON object, got {_short(schema)}"
        )
    try:
        return json.dumps(closed_objects(schema), separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidStructuredOutputError(f"json schema is not serializable: {e}") from e


# Where a schema holds subschemas: one, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: object) -> object:
    """The schema with every object that lists its `properties` closed to them, unless it says
    otherwise (additionalProperties, patternProperties, unevaluatedProperties). JSON Schema leaves
    such objects open, and a small model then invents keys until max_tokens ({"a": 2, "b": 2,
    "c": 1}, or a runaway "mathsksqrt": ...); vLLM's default backend and OpenAI's strict mode
    allow only the declared keys, and so do we. An object schema without `properties`
    ({"type": "object"}, json_object) stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=256)
def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for the spec, validated (errors are not cached: they are cheap)."""
    try:
        if spec.kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec.text)
        else:
            alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.text))
            grammar = LLMatcher.grammar_from_lark(f"start: {alternatives}")
    except ValueError as e:
        raise InvalidStructuredOutputError(f"invalid {spec.kind} constraint: {e}") from e
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidStructuredOutputError(f"invalid {spec.kind} constraint: {error.strip()}")
    return grammar


class GrammarCompiler:
    """Compiles specs against one tokenizer and hands out a fresh matcher per request."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        capacity: int = _DEFAULT_CAPACITY,
    ) -> None:
        self._tokenizer = tokenizer
        # The bitmask must cover every logit; ids past the tokenizer's vocabulary are never allowed.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[GrammarSpec, LLMatcher] = OrderedDict()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def matcher(self, spec: GrammarSpec) -> RequestMatcher:
        compiled = self._compiled.get(spec)
        if compiled is None:
            self.misses += 1
            compiled = self._compile(spec)
            self._compiled[spec] = compiled
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self.hits += 1
            self._compiled.move_to_end(spec)
        return RequestMatcher(compiled.deep_copy())

    def _compile(self, spec: GrammarSpec) -> LLMatcher:
        matcher = LLMatcher(self._llguidance_tokenizer(), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidStructuredOutputError(
                f"invalid {spec.kind} constraint: {matcher.get_error()}"
            )
        return matcher

    def _llguidance_tokenizer(self) -> LLTokenizer:
        # Built on first use (about 0.3 s for a 49k vocabulary), so engines that never see a
        # constrained request never pay for it.
        if self._ll_tokenizer is None:
            from llguidance.hf import from_tokenizer

            eos = self._eos_token_ids or None  # None: the tokenizer's own EOS
            self._ll_tokenizer = from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=eos
            )
        return self._ll_tokenizer


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
