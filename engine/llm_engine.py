"""LLMEngine: text in, text out, step by step. Wraps EngineCore with tokenization, incremental
detokenization, stop strings, and n > 1 fan-out (each sample is its own core request; they share
the prompt's KV blocks through the prefix cache)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_builder import build_engine_core
from engine.errors import InvalidRequestError
from engine.model_fetch import resolve_model
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.pooling import PoolingParams
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer, render_chat

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    finish_reason: str | None = None
    # Text released so far: while running it never ends in a possible start of a stop string,
    # so streamed deltas (text[len(previous):]) never have to be taken back.
    text: str = ""


@dataclass(slots=True)
class _Group:
    """One caller request: its n samples and the prompt they share."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)
    error: str | None = None  # why the engine failed one of its samples (then all of them)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model(config.model)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.core = build_engine_core(config, model_dir, self.tokenizer)
        self._groups: dict[str, _Group] = {}
        self._sample_to_group: dict[str, str] = {}

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("a prompt must be a string or a list of token ids")
        return None, list(prompt)

    def encode_chat(self, messages: list[dict], **template_options) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template")
        return render_chat(self.tokenizer, messages, **template_options)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """prompt_text: the text a token-id prompt was encoded from, reported back as the
        output's prompt (callers that tokenize themselves keep their text). pooling: an
        embedding request (params with max_tokens=0), its vector in RequestOutput.embedding."""
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        if pooling is not None and params.n != 1:
            raise InvalidRequestError("a pooling request has one result: n must be 1", "n")
        text, token_ids = self.encode_prompt(prompt)
        group = _Group(request_id, text if prompt_text is None else prompt_text, token_ids)
        sample_params = (
            [params] if params.n == 1 else [params.clone_for_sample(i) for i in range(params.n)]
        )
        # One arrival for the caller's request: every sample's latencies count from it.
        arrival_time = time.time() if arrival_time is None else arrival_time
        try:
            for i, sp in enumerate(sample_params):
                sample_id = request_id if params.n == 1 else f"{request_id}#{i}"
                req = self.core.add_request(
                    sample_id, token_ids, sp, arrival_time, priority, pooling
                )
                # A prefill-only request has no output text to stream.
                detok = (
                    IncrementalDetokenizer(self.tokenizer, token_ids, sp)
                    if self.tokenizer and not req.prefill_only
                    else None
                )
                group.samples.append(_Sample(req, detok))
                self._sample_to_group[sample_id] = request_id
        except ValueError:
            self._drop(group)
            raise
        self._groups[request_id] = group

    def _drop(self, group: _Group) -> None:
        ids = [s.request.request_id for s in group.samples]
        self.core.abort(ids)
        for sid in ids:
            self._sample_to_group.pop(sid, None)

    def abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is not None:
            self._drop(group)

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def step(self) -> list[RequestOutput]:
        changed: dict[str, _Group] = {}
        for out in self.core.step():
            group_id = self._sample_to_group.get(out.request.request_id)
            group = self._groups.get(group_id)
            if group is None or group.error is not None:
                continue  # a sibling failed earlier in this step: the group has ended
            sample = next(s for s in group.samples if s.request is out.request)
            changed[group_id] = group
            if out.request.status is RequestStatus.FINISHED_ERROR:
                self._fail(group, out.request.error or "the engine failed")
                continue
            try:
                self._advance(sample, out.num_new_tokens, out.finished)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                logger.exception("request %s: detokenizing failed", group_id)
                self._fail(group, f"detokenizing failed: {e}")
        outputs = []
        for group_id, group in changed.items():
            outputs.append(self._output(group))
            if group.finished:
                del self._groups[group_id]
                for s in group.samples:
                    self._sample_to_group.pop(s.request.request_id, None)
        return outputs

    def _fail(self, group: _Group, error: str) -> None:
        """One sample failed: the caller's request fails, so its other samples stop too."""
        group.error = error
        for s in group.samples:
            self.core.finish(s.request.request_id, RequestStatus.FINISHED_ERROR)
            if s.finish_reason is None:
                s.finish_reason = RequestStatus.FINISHED_ERROR.value

    def _advance(self, sample: _Sample, num_new: int, finished: bool) -> None:
        request = sample.request
        if sample.detokenizer is not None and num_new:
            new_ids = request.output_token_ids[-num_new:]
            if finished and _ended_by_stop_token(request):
                # As in vLLM, the token that stopped the request (EOS, a stop_token_ids entry)
                # stays in token_ids but not in the text, unless include_stop_str_in_output.
                new_ids = new_ids[:-1]
            stop = sample.detokenizer.update(new_ids)
            if stop is not None:
                # Several tokens can arrive in one step (speculative decoding): those after the
                # one that completed the stop string are not part of the output.
                self.core.stop_string(request, stop, sample.detokenizer.num_tokens)
                finished = True
        if finished:
            sample.finish_reason = request.status.value
        if sample.detokenizer is not None:
            sample.text += sample.detokenizer.get_next_delta(finished)

    def _output(self, group: _Group) -> RequestOutput:
        first = group.samples[0].request
        completions = [
            CompletionOutput(
                index=i,
                text=s.text,
                token_ids=list(s.request.output_token_ids),
                logprobs=list(s.request.output_logprobs)
                if s.request.params.logprobs is not None
                else None,
                finish_reason=s.finish_reason,
                stop_reason=s.request.stop_reason,
                metrics=_sample_metrics(s),
            )
            for i, s in enumerate(group.samples)
        ]
        finish_times = [s.request.finish_time for s in group.samples]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(
                (s.request.first_token_time for s in group.samples if s.request.first_token_time),
                default=None,
            ),
            finish_time=max(finish_times) if group.finished and all(finish_times) else None,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            num_draft_tokens=sum(s.request.num_draft_tokens for s in group.samples),
            num_accepted_tokens=sum(s.request.num_accepted_tokens for s in group.samples),
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            metrics=metrics,
            prompt_logprobs=first.prompt_logprobs
            if first.params.prompt_logprobs is not None
            else None,
            error=group.error,
            embedding=first.pooling.embedding if first.pooling is not None else None,
        )


def _sample_metrics(sample: _Sample) -> RequestMetrics:
    r = sample.request
    return RequestMetrics(
        arrival_time=r.arrival_time,
        first_scheduled_time=r.first_scheduled_time,
        first_token_time=r.first_token_time,
        finish_time=r.finish_time if sample.finish_reason is not None else None,
        num_cached_tokens=max(r.num_cached_tokens, 0),
        num_draft_tokens=r.num_draft_tokens,
        num_accepted_tokens=r.num_accepted_tokens,
    )


def _ended_by_stop_token(request: Request) -> bool:
    """The request stopped on a stop token (one of stop_token_ids, or EOS), not on a stop string
    or a completed grammar, whose last token belongs to the text."""
    if request.status is not RequestStatus.FINISHED_STOPPED:
        return False
    if request.params.include_stop_str_in_output or not request.output_token_ids:
        return False
    last = request.output_token_ids[-1]
    if isinstance(request.stop_reason, int) and request.stop_reason == last:
        return True
    return not request.params.ignore_eos and last in request.eos_token_ids
