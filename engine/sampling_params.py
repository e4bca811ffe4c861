"""Per-request sampling parameters, validated once at construction (names follow vLLM)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParamsError
from engine.structured.grammar import parse_spec

# torch generators take 64-bit seeds; n > 1 samples use seed + index, so keep room for the index.
_MAX_SAMPLES = 1 << 16
_MAX_SEED = (1 << 63) - _MAX_SAMPLES


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # top-k logprobs per sampled token (the sampled one always included)
    )
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output: {"json": schema}, {"regex": pattern} or {"choice": [strings]}; the output
    # is constrained to it and the request stops when it is complete (engine/structured/).
    structured: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"{name} must be {rule}, got {value!r}")

        # Written as "not (valid)" so that NaN, for which every comparison is False, is rejected.
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", self.temperature, ">= 0 and finite")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0 and finite")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.seed is not None and not 0 <= self.seed < _MAX_SEED:
            raise bad("seed", self.seed, f"in [0, 2**63 - {_MAX_SAMPLES})")
        if self.n > _MAX_SAMPLES:
            raise bad("n", self.n, f"<= {_MAX_SAMPLES}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", self.logprobs, ">= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", self.prompt_logprobs, ">= 0")
        if self.structured is not None:
            parse_spec(self.structured)  # raises InvalidStructuredOutputError naming the problem

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Parameters for the index-th of n samples: n=1, and a distinct seed when one is set."""
        seed = None if self.seed is None else self.seed + index
        params = SamplingParams(**{f: getattr(self, f) for f in self.__dataclass_fields__})
        params.n = 1
        params.seed = seed
        return params
