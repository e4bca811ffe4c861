"""Continuous batching in the vLLM v1 manner.

There are no prefill and decode phases: each request has a count of computed tokens that catches up
with its token count (prompt + outputs) inside a per-step token budget. Running requests go first
(a decode costs one token, an unfinished prompt a chunk), then waiting requests are admitted while
budget, sequence slots and KV blocks last. When blocks run out, the lowest-priority, latest-arrived
running request is preempted: its blocks are freed and it is recomputed later (its full blocks
usually come back from the prefix cache).

With speculative decoding a decoding request also carries proposed tokens: it is scheduled for
1 + k tokens (its last token and k drafts) in the same step as everybody else, and update() takes
the tokens verification kept, rolls the computed count back over the rejected drafts and frees
the blocks that only they used.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Slots allocated past a scheduled chunk for a draft model to write its guesses' K/V after
    # this step (vLLM's num_lookahead_tokens); 0 without a draft model.
    num_lookahead_tokens: int = 0


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step, from request.num_computed_tokens on
    # Proposed tokens verified this step: the last num_tokens positions are the request's last
    # token followed by these (num_tokens = 1 + len(spec_token_ids) when there are any).
    spec_token_ids: list[int] = field(default_factory=list)
    # The request's block table as scheduled: the executor reads blocks from here, never from
    # the KV manager, so a SchedulerOutput is all it needs.
    block_ids: list[int] = field(default_factory=list)
    # Whether this chunk reaches the end of the request's tokens, so it yields a new token (a
    # prefill-only request never does: it ends there). Fixed when scheduled: update() moves the
    # request's counts on afterwards.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.request.num_computed_tokens + self.num_tokens
        self.samples = end == self.request.num_tokens + len(self.spec_token_ids) and (
            not self.request.prefill_only
        )

    def attention_pairs(self, computed_before: int) -> int:
        """Query-key pairs this chunk's causal attention computes: n new tokens after
        `computed_before` cached ones attend n * computed_before + n (n + 1) / 2 keys."""
        n = self.num_tokens
        return n * computed_before + n * (n + 1) // 2

    @property
    def num_sample_rows(self) -> int:
        """Logit rows this chunk yields: one per proposed token plus one after the last."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk or a recompute (not a decode, with or without proposed tokens)."""
        return self.num_tokens - len(self.spec_token_ids) > 1


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # A step that had to preempt admits nobody: memory is short already.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            spec = request.spec_token_ids
            num_new = min(request.num_tokens - request.num_computed_tokens + len(spec), budget)
            # Drafts past the budget are dropped (a request whose prompt is unfinished has none).
            spec = spec[: max(0, num_new - 1)]
            while not self.kv.allocate_slots(request, num_new, num_lookahead=self._lookahead):
                victim = max(self.running, key=lambda r: r.sort_key)
                if self.running.index(victim) < i:
                    i -= 1  # an already scheduled one: the list shifts under us
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                request.spec_token_ids = []
                out.scheduled.append(self._scheduled(request, num_new, spec))
                budget -= num_new
                i += 1
        return budget

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt by recompute; returns the budget the victim had taken this step, if any."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        bisect.insort(self.waiting, victim, key=lambda r: r.sort_key)
        for j, s in enumerate(out.scheduled):
            if s.request is victim:
                del out.scheduled[j]
                return s.num_tokens
        return 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, computed, self._lookahead):
                break  # FCFS: the head waits for memory; nobody overtakes it
            self.kv.record_prefix_query(request.num_tokens, num_cached)
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    @property
    def _lookahead(self) -> int:
        return self.config.num_lookahead_tokens

    def _scheduled(self, request: Request, num_new: int, spec: list[int] | None = None):
        return ScheduledRequest(request, num_new, spec or [], self.kv.block_ids(request.request_id))

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        resample: Collection[str] = (),
    ) -> list[Request]:
        """Advance computed counts, append the new tokens (one, or the accepted drafts and one
        more) up to a stop, finish requests; returns the finished. Requests in `resample` got
        no token this step (another request's sampling failed with theirs): their last position
        is computed again next step, which samples it. A prefill-only request finishes once
        its prompt is computed: a pooling request as "stop" (it is complete, as in vLLM), a
        max_tokens=0 one as "length" (it reached its token limit; OpenAI's answer to it)."""
        finished = []
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_tokens
            if request.prefill_only:
                if request.num_computed_tokens >= request.num_prompt_tokens:
                    if not request.status.finished:
                        pooled = request.pooling is not None
                        stop, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
                        self.finish(request, stop if pooled else length)
                        finished.append(request)
                continue
            if request.request_id in resample and not request.status.finished:
                self._roll_back(request, 1 + len(s.spec_token_ids))
                continue
            tokens = sampled.get(request.request_id)
            if tokens is None or request.status.finished:
                continue
            if s.spec_token_ids:
                self._roll_back(request, len(s.spec_token_ids) - (len(tokens) - 1))
            for token in tokens:
                request.output_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
                    break
        return finished

    def _roll_back(self, request: Request, num_rejected: int) -> None:
        """Forget the K/V of rejected drafts: their slots are overwritten later, and blocks that
        held nothing else go back to the pool. None of them is in the prefix cache: blocks are
        registered only up to the request's known tokens, which drafts are not."""
        request.num_computed_tokens -= num_rejected
        # A draft model writes its next guesses' K/V into the lookahead slots: keep those.
        self.kv.trim(request, request.num_computed_tokens + self._lookahead)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        num_out = len(request.output_token_ids)
        if request.matcher is not None and request.matcher.terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request wherever it is (running, waiting), freeing its blocks at once."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
