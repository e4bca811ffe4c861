"""Per-request sampling parameters, validated once at construction (names follow vLLM)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.errors import InvalidSamplingParamsError
from engine.structured.grammar import parse_spec

# torch generators take 64-bit seeds; n > 1 samples use seed + index, so keep room for the index.
_MAX_SAMPLES = 1 << 16
_MAX_SEED = (1 << 63) - _MAX_SAMPLES
# OpenAI's logit_bias range: -100 bans a token in practice, +100 makes it the only choice.
MAX_LOGIT_BIAS = 100.0
# Token ids and counts become int64 tensors in the sampler; anything larger cannot be one.
_MAX_INT64 = (1 << 63) - 1


def _f32(value: float) -> float:
    """The value as the sampler computes with it: logits are float32, so a top_p of 1e-50 is 0.0
    there and a temperature of 1e39 is inf, whatever float64 validation saw."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


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
    # token id -> added to its logit before sampling (OpenAI's logit_bias), in [-100, 100].
    logit_bias: dict[int, float] | None = None

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
            return InvalidSamplingParamsError(f"{name} must be {rule}, got {value!r}", param=name)

        # Written as "not (valid)" so that NaN, for which every comparison is False, is rejected.
        # Floats are checked as float32 too, the dtype the sampler uses.
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not (0.0 <= self.temperature < math.inf and _f32(self.temperature) < math.inf):
            raise bad("temperature", self.temperature, ">= 0 and finite (in float32)")
        if not (0.0 < self.top_p <= 1.0 and _f32(self.top_p) > 0.0):
            raise bad("top_p", self.top_p, "in (0, 1] and not 0 in float32 (>= 1.2e-38)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        penalty = self.repetition_penalty
        if not (0.0 < penalty < math.inf and 0.0 < _f32(penalty) < math.inf):
            raise bad("repetition_penalty", penalty, "> 0 and finite (in float32)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < _MAX_SEED):
            raise bad("seed", self.seed, f"an integer in [0, 2**63 - {_MAX_SAMPLES})")
        if self.n > _MAX_SAMPLES:
            raise bad("n", self.n, f"<= {_MAX_SAMPLES}")
        # max_tokens=0 is a prefill-only request: the prompt is computed (prompt logprobs,
        # pooled hidden states) and nothing is generated.
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", self.max_tokens, "an integer >= 0")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not _is_int(t) or not 0 <= t <= _MAX_INT64 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "an integer >= 0")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer >= 0")
        if self.logit_bias is not None:
            self._validate_logit_bias()
        if self.structured is not None:
            parse_spec(self.structured)  # raises InvalidStructuredOutputError naming the problem

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise InvalidSamplingParamsError(
                f"logit_bias must be a map of token id to bias, got {bias!r}", param="logit_bias"
            )
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token <= _MAX_INT64:
                raise InvalidSamplingParamsError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                    param="logit_bias",
                )
            if not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
            ):
                raise InvalidSamplingParamsError(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r} for token "
                    f"{token}",
                    param="logit_bias",
                )

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Parameters for the index-th of n samples: n=1, and a distinct seed when one is set."""
        seed = None if self.seed is None else self.seed + index
        params = SamplingParams(**{f: getattr(self, f) for f in self.__dataclass_fields__})
        params.n = 1
        params.seed = seed
        return params


def generator_seed(seed: int) -> int:
    """Any integer as a seed this class accepts, deterministically: the OpenAI API takes any
    64-bit seed (negative too), torch's generators and the per-sample offsets need less."""
    return seed % _MAX_SEED


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
