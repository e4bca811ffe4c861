"""What the engine returns to callers (names follow vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated (or prompt) position: token id -> log-probability, holding the top-k tokens and
# the sampled token itself.
TokenLogprobs = dict[int, float]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    # Speculative decoding, summed over the request's samples: tokens proposed and verified,
    # and of those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # This sample's own times and counts: each sample is its own engine request (as each of
    # vLLM's n child requests is), so it has its own schedule, first token and finish.
    # RequestOutput.metrics is the group's (earliest first token, latest finish).
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Set when the engine failed this request (finish_reason "error"): what went wrong.
    error: str | None = None
    # A pooling request's pooled final hidden state (engine/pooling.py), once finished.
    embedding: list[float] | None = None
    extra: dict = field(default_factory=dict)
