"""EngineCore: the token-level engine. add_request / step / abort over scheduler, KV cache,
runner and sampler; no text here (tokenizing and detokenizing live in LLMEngine)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.errors import STRUCTURED_OUTPUT_FAILED, ExecutorFailedError, InvalidRequestError
from engine.executor import Executor
from engine.pooling import PoolingParams, PoolingState
from engine.profiler import StepProfiler, StepRecord
from engine.request import Request, RequestStatus, make_request
from engine.sampler import Sampler, SamplingRow, prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.spec.proposer import Proposer
from engine.spec.rejection_sampler import RejectionSampler
from engine.spec.stats import SpecDecodeStats
from engine.structured.bitmask import GrammarMask, fill_grammar_mask
from engine.structured.grammar import GrammarCompiler, parse_spec
from engine.structured.matcher import RequestMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreOutput:
    request: Request
    num_new_tokens: int  # tokens appended to request.output_token_ids this step
    finished: bool


class EngineCore:
    """Steps a scheduler over an executor: admission, one forward per step, sampling, stop
    checks, retiring finished requests, proposing drafts. Built by engine_builder (the real
    model) or by capacity.simulate (the performance model on a virtual clock): both run this
    code."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        sampler: Sampler,
        proposer: Proposer | None,
        clock: Callable[[], float] = time.time,
        *,
        config: EngineConfig,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        device: torch.device,
        hidden_size: int | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        rejection_sampler: RejectionSampler | None = None,
    ) -> None:
        """clock: the time requests are stamped with (arrival, first token, finish); a
        simulation passes its virtual clock. sampler / rejection_sampler: draw tokens from the
        executor's logits (a simulation's decide them without). device: where the logits live
        (seeded generators are made there). hidden_size: the width pooling requests get (None:
        no pooling)."""
        self.config = config
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.executor = executor
        self.sampler = sampler
        self.proposer = proposer
        self.clock = clock
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.device = device
        self.num_blocks = executor.num_blocks
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = (
            GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids)
            if tokenizer is not None
            else None
        )
        self.requests: dict[str, Request] = {}
        self.rejection_sampler = rejection_sampler or RejectionSampler()
        self.spec_stats = SpecDecodeStats()
        self._rng = torch.Generator(device=device).manual_seed(config.seed)
        self._arrivals = itertools.count()
        self._steps = itertools.count()
        self.profiler = StepProfiler(config.profile_path) if config.profile_path else None
        self._last_step_end: float | None = None  # perf_counter at the end of a step that left
        # work behind; the next step's gap_s is measured from it

    def shutdown(self) -> None:
        self.executor.shutdown()

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) that can ever be served."""
        return min(self.max_model_len, self.num_blocks * self.config.block_size)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
    ) -> Request:
        """pooling: an embedding request (params must have max_tokens=0): its prompt's final
        hidden states pooled, in the finished request's pooling.embedding."""
        request = self.make_request(
            request_id, prompt_token_ids, params, arrival_time, priority, pooling
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
    ) -> Request:
        """A checked Request, not yet added (engine.request.make_request builds it)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        max_tokens = self._check_prompt(prompt_token_ids, params)
        if pooling is not None:
            self._check_pooling(pooling, params)
        matcher = self._matcher(params)
        return make_request(
            request_id,
            prompt_token_ids,
            params,
            max_tokens,
            self.clock() if arrival_time is None else arrival_time,
            next(self._arrivals),
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            generator=self._generator(params),
            matcher=matcher,
            pooling=None if pooling is None else PoolingState(pooling, len(prompt_token_ids)),
        )

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty: at least one token is required", "prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt"
            )
        if params.max_tokens == 0 and n > self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len}", "prompt"
            )
        if params.max_tokens != 0 and n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens leave room for one output token",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}",
                "max_tokens",
            )
        blocks = self.kv.blocks_needed(n + max_tokens)
        if blocks > self.num_blocks:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks but the "
                f"whole pool has {self.num_blocks}; the longest request that fits has "
                f"{self.max_request_tokens} tokens",
                "max_tokens",
            )
        return max_tokens

    def _check_pooling(self, pooling: PoolingParams, params: SamplingParams) -> None:
        if params.max_tokens != 0:
            raise InvalidRequestError(
                "a pooling request computes its prompt only: it needs max_tokens=0", "max_tokens"
            )
        width = self.hidden_size
        if width is None:
            raise InvalidRequestError("this engine computes no hidden states to pool")
        if pooling.dimensions is not None and pooling.dimensions > width:
            raise InvalidRequestError(
                f"dimensions must be at most the model's hidden size {width}, "
                f"got {pooling.dimensions}",
                "dimensions",
            )

    def _matcher(self, params: SamplingParams) -> RequestMatcher | None:
        """A fresh grammar state for a constrained request (each of n samples gets its own)."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError("structured output needs a tokenizer; this engine has none")
        return self.grammars.matcher(parse_spec(params.structured))

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        if params.seed is None:
            return self._rng
        return torch.Generator(device=self.device).manual_seed(params.seed)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_ids: list[str]) -> list[Request]:
        return [r for rid in request_ids if (r := self.finish(rid, RequestStatus.FINISHED_ABORTED))]

    def finish(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request now (abort, or a stop string seen by the detokenizer); frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, status)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        request.finish_time = self.clock()
        return request

    def stop_string(self, request: Request, stop: str, num_output_tokens: int) -> None:
        """The detokenizer found stop string `stop` ending at output token num_output_tokens:
        the request keeps those tokens and ends as "stop", whether it is still running or this
        step finished it already (several tokens can arrive in one step)."""
        del request.output_token_ids[num_output_tokens:]
        del request.output_logprobs[num_output_tokens:]
        if request.request_id in self.requests:
            self.finish(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
            return
        request.stop_reason = stop
        request.status = RequestStatus.FINISHED_STOPPED

    @torch.inference_mode()
    def step(self) -> list[CoreOutput]:
        """One scheduled batch through the model and the sampler. A failure that one request
        causes (its sampling, its prompt logprobs) fails that request alone; a failure of the
        forward itself fails the requests of this step. The engine stays usable either way."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        now = self.clock()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        try:
            result = self.executor.execute(sched)
        except ExecutorFailedError:
            raise  # nothing can compute any more: the caller must stop
        except Exception as e:  # noqa: BLE001 - isolated below, the engine goes on
            # One forward computes the whole batch, so no request can be blamed alone: every
            # request in it fails; the others (waiting, or not scheduled) go on.
            logger.exception(
                "model forward failed; failing the %d requests of this step", len(sched.scheduled)
            )
            return self._fail(
                {s.request.request_id: f"model forward failed: {e}" for s in sched.scheduled},
                uncomputed=True,
            )
        errors: dict[str, str] = {}
        for request_id, (first, logits) in result.prompt_logits.items():
            try:
                self._add_prompt_logprobs(self.requests[request_id], first, logits)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                logger.exception("request %s: prompt logprobs failed", request_id)
                errors[request_id] = f"prompt logprobs failed: {e}"
        for request_id, (first, hidden) in result.pooled_hidden.items():
            if request_id in errors:
                continue
            try:
                self.requests[request_id].pooling.add(first, hidden)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                logger.exception("request %s: pooling failed", request_id)
                errors[request_id] = f"pooling failed: {e}"
        sampled, resample = self._sample(result.sampled, result.logits, errors)
        failed = self._fail(errors)
        num_before = {
            s.request.request_id: len(s.request.output_token_ids) for s in sched.scheduled
        }
        finished = self.scheduler.update(sched, sampled, resample)
        # The requests that got tokens this step (not the failed, not those sampling again).
        advanced = [s for s in result.sampled if s.request.request_id in sampled]
        # Prefill-only requests whose prompt is now computed: they end with no token.
        ended = {r.request_id for r in finished}
        prefilled = [
            s for s in sched.scheduled if s.request.prefill_only and s.request.request_id in ended
        ]
        outputs = failed + self._outputs(advanced + prefilled, num_before, finished)
        if self.proposer is not None:
            self._propose(advanced)
        if self.profiler is not None:
            end = time.perf_counter()
            gap = start - self._last_step_end if self._last_step_end is not None else 0.0
            self._profile(sched, result.num_context_tokens, end - start, gap, len(result.logits))
            self._last_step_end = end if self.scheduler.has_unfinished() else None
        return outputs

    def _fail(self, errors: dict[str, str], uncomputed: bool = False) -> list[CoreOutput]:
        """End these requests with FINISHED_ERROR. uncomputed: their K/V of this step was never
        written, so none of their blocks past the computed tokens may stay in the prefix cache."""
        outputs = []
        for request_id, message in errors.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            if uncomputed:
                self.kv.forget_uncomputed(request)
            self.finish(request_id, RequestStatus.FINISHED_ERROR)
            request.error = message
            outputs.append(CoreOutput(request, 0, True))
        return outputs

    def _sample(
        self, items: list[ScheduledRequest], logits: torch.Tensor, errors: dict[str, str]
    ) -> tuple[dict[str, list[int]], set[str]]:
        """(request id -> its new tokens, requests to sample again next step). Each gets one
        token, or with proposed tokens the accepted ones and one more (rejection_sampler).
        Requests already in `errors` are skipped; a request whose sampling fails is added there.

        When the batch's sampling fails, each request is sampled alone on a copy to find the
        one(s) that fail: they fail; the others keep this step's K/V and sample the same
        position again next step, since the failed attempt may have changed their logits in
        place. When none fails alone, all of them fail: the batch cannot be split."""
        live = [i for i, s in enumerate(items) if s.request.request_id not in errors]
        if not live:
            return {}, set()
        if len(live) < len(items):
            logits = logits[_row_index(items, live, logits.device)]
            items = [items[i] for i in live]
        try:
            drawn = self._draw(items, logits)
        except Exception as e:  # noqa: BLE001 - blamed below
            logger.exception("sampling failed for a batch of %d requests", len(items))
            blamed = self._blame(items, logits)
            if not blamed:
                blamed = {s.request.request_id: f"sampling failed: {e}" for s in items}
            errors.update(blamed)
            return {}, {s.request.request_id for s in items} - blamed.keys()
        sampled = {}
        for s, tokens, entries, accepted in zip(items, *drawn, strict=True):
            request = s.request
            try:
                self._record(request, s.spec_token_ids, tokens, entries, accepted)
            except StructuredOutputFailed as e:
                errors[request.request_id] = str(e)
                continue
            except Exception as e:  # noqa: BLE001 - this request's own failure
                logger.exception("request %s: recording its tokens failed", request.request_id)
                errors[request.request_id] = f"sampling failed: {e}"
                continue
            sampled[request.request_id] = tokens
        return sampled, set()

    def _draw(
        self, items: list[ScheduledRequest], logits: torch.Tensor, probe: bool = False
    ) -> tuple[list[list[int]], list[list], list[int]]:
        """Per request: its new tokens, their logprob entries, accepted drafts. No request state
        changes here. probe: draw from torch's default generator; seeded ones stay untouched."""
        requests = [s.request for s in items]
        # One row per logits row: a request verifying k drafts has k + 1, row j seeing the
        # first j drafts as already generated.
        rows = [
            SamplingRow(
                params=r.params,
                generator=None if probe else r.generator,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                stop_token_ids=r.min_tokens_stop_ids,
                draft_token_ids=s.spec_token_ids[:j],
            )
            for s, r in zip(items, requests)
            for j in range(s.num_sample_rows)
        ]
        matchers = [r.matcher for s, r in zip(items, requests) for _ in range(s.num_sample_rows)]
        grammar = self._grammar_mask(matchers)
        drafts = [s.spec_token_ids for s in items]
        if any(drafts):
            out = self.rejection_sampler(logits, rows, drafts, grammar)
            return out.token_ids, out.logprobs, out.num_accepted
        plain = self.sampler(logits, rows, grammar)
        return [[t] for t in plain.token_ids], [[lp] for lp in plain.logprobs], [0] * len(items)

    def _blame(self, items: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, str]:
        """The requests whose sampling fails on its own, with why."""
        blamed = {}
        offsets = _row_offsets(items)
        for i, s in enumerate(items):
            rows = logits[offsets[i] : offsets[i + 1]].clone()
            try:
                self._draw([s], rows, probe=True)
            except Exception as e:  # noqa: BLE001 - the finding
                blamed[s.request.request_id] = f"sampling failed: {e}"
        return blamed

    def _record(
        self, request: Request, draft: list[int], tokens: list[int], entries: list, accepted: int
    ) -> None:
        if draft:
            request.num_draft_tokens += len(draft)
            request.num_accepted_tokens += accepted
            self.spec_stats.observe(len(draft), accepted)
        if request.params.logprobs is not None:
            request.output_logprobs += entries
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        if request.matcher is not None:
            self._accept(request, tokens[0])  # constrained requests never speculate

    def _propose(self, items: list[ScheduledRequest]) -> None:
        """Proposals for the next step, for requests that just sampled and keep decoding.
        Constrained requests do not speculate: their grammar state would have to follow every
        draft and roll back with the rejected ones."""
        k_max = self.config.num_speculative_tokens
        wanted = []
        for s in items:
            r = s.request
            if r.status != RequestStatus.RUNNING or r.matcher is not None:
                continue
            # Never propose past the request's end: max_tokens, then max_model_len.
            k = min(
                k_max,
                r.max_tokens - len(r.output_token_ids) - 1,
                self.max_model_len - r.num_tokens - 1,
            )
            if k >= 1:
                wanted.append((r, k))
        if not wanted:
            return
        try:
            self.proposer.propose(wanted)
        except Exception:  # noqa: BLE001 - drafts only save time; without them output is the same
            logger.exception("proposing draft tokens failed; this step's requests decode without")
            for r, _ in wanted:
                r.spec_token_ids = []

    def _grammar_mask(self, matchers: list[RequestMatcher | None]) -> GrammarMask | None:
        if self.grammars is None:
            return None
        return fill_grammar_mask(matchers, self.grammars.bitmask_words)

    def _accept(self, request: Request, token: int) -> None:
        """Advance the request's grammar; the scheduler ends the request once it is complete.
        A grammar that breaks fails the request: its text would no longer follow the
        constraint, and ending it as "stop" would pass that off as a success."""
        ok = request.matcher.accept(token)
        if ok and not request.matcher.failed:
            return
        # Reachable when llguidance hits one of its limits (too many items, a lexer blow-up:
        # hostile schemas and regexes), or when a later filter (min_tokens) masked every token
        # the grammar allowed. The error can quote the whole grammar: keep the log short.
        error = _short(request.matcher.error.split("\n")[0], 300)
        logger.warning(
            "request %s: its grammar broke at token %d: %s", request.request_id, token, error
        )
        raise StructuredOutputFailed(f"{STRUCTURED_OUTPUT_FAILED}: {error}")

    def _add_prompt_logprobs(self, request: Request, first: int, logits: torch.Tensor) -> None:
        k = request.params.prompt_logprobs or 0
        if first == 0:
            request.prompt_logprobs = [None]  # the first prompt token has no context
        targets = request.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]]
        request.prompt_logprobs.extend(prompt_logprobs(logits, targets, k))

    def _outputs(
        self,
        items: list[ScheduledRequest],
        num_before: dict[str, int],
        finished: list[Request],
    ) -> list[CoreOutput]:
        done = {r.request_id for r in finished}
        now = self.clock()
        outputs = []
        for s in items:
            request = s.request
            rid = request.request_id
            num_new = len(request.output_token_ids) - num_before[rid]
            # Tokens verification emitted past a stop were not appended: drop their logprobs.
            del request.output_logprobs[len(request.output_token_ids) :]
            if rid in done:
                request.finish_time = now
                del self.requests[rid]
                if self.proposer is not None:
                    self.proposer.forget(rid)
            outputs.append(CoreOutput(request, num_new, rid in done))
        return outputs

    def _profile(
        self, sched: SchedulerOutput, context_tokens: int, wall: float, gap: float, rows: int
    ) -> None:
        # update() has advanced num_computed_tokens already: the chunk started n tokens earlier.
        pairs = sum(
            s.attention_pairs(s.request.num_computed_tokens - s.num_tokens) for s in sched.scheduled
        )
        self.profiler.record(
            StepRecord(
                step=next(self._steps),
                time=self.clock(),
                wall_s=wall,
                batch_size=len(sched.scheduled),
                num_batched_tokens=sched.num_batched_tokens,
                prefill_tokens=sum(s.num_tokens for s in sched.scheduled if s.is_prefill),
                decode_requests=sum(1 for s in sched.scheduled if not s.is_prefill),
                draft_tokens=sum(len(s.spec_token_ids) for s in sched.scheduled),
                context_tokens=context_tokens,
                num_preempted=len(sched.preempted),
                num_waiting=len(self.scheduler.waiting),
                attention_pairs=pairs,
                sampled_requests=rows,
                gap_s=gap,
            )
        )


class StructuredOutputFailed(RuntimeError):
    """A request's grammar broke while it generated."""


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _row_offsets(items: list[ScheduledRequest]) -> list[int]:
    """Where each item's logits rows start (and, last, where they end)."""
    return list(itertools.accumulate((s.num_sample_rows for s in items), initial=0))


def _row_index(items: list[ScheduledRequest], picked: list[int], device) -> torch.Tensor:
    offsets = _row_offsets(items)
    rows = [r for i in picked for r in range(offsets[i], offsets[i + 1])]
    return torch.tensor(rows, dtype=torch.long, device=device)
