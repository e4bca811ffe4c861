"""A request's state inside the engine core: tokens, progress, blocks-independent bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.outputs import TokenLogprobs
from engine.pooling import PoolingState
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.matcher import RequestMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The engine failed while computing it (request.error says how); other requests go on.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None here
    arrival_time: float
    arrival_seq: int  # tie-break in arrival order
    priority: int = 0  # lower runs first (vLLM's convention)
    eos_token_ids: frozenset[int] = frozenset()
    # ids masked while fewer than min_tokens are out: stop ids, and EOS unless ignore_eos
    min_tokens_stop_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache at first schedule
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    generator: torch.Generator | None = None
    # Structured output: the grammar state after output_token_ids (None: unconstrained).
    matcher: RequestMatcher | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # set with FINISHED_ERROR
    # A pooling (embedding) request: its prompt's hidden states, pooled as they are computed.
    pooling: PoolingState | None = None
    # Speculative decoding: tokens proposed after the last output token, verified by the next
    # step that schedules the request; and what this request's verifications added up to.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prefill_only(self) -> bool:
        """max_tokens=0 (prompt logprobs, pooling): it ends once its prompt is computed and
        never samples."""
        return self.max_tokens == 0

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether every prompt position must be computed by this request, so that no prefix-cache
        hit may skip any: prompt logprobs, and pooling over all positions."""
        return self.params.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.params.needs_every_position
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    arrival_time: float,
    arrival_seq: int,
    *,
    priority: int = 0,
    eos_token_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    matcher: RequestMatcher | None = None,
    pooling: PoolingState | None = None,
) -> Request:
    """The one constructor of a Request: EngineCore (for the engine and the capacity
    simulation, after checking the request) and the memory profiler's dummy batch use it, so
    every request's derived fields are made the same way."""
    stop_ids = frozenset(params.stop_token_ids)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        max_tokens=max_tokens,
        arrival_time=arrival_time,
        arrival_seq=arrival_seq,
        priority=priority,
        eos_token_ids=eos_token_ids,
        min_tokens_stop_ids=stop_ids | (frozenset() if params.ignore_eos else eos_token_ids),
        generator=generator,
        matcher=matcher,
        pooling=pooling,
    )
