"""POST /v1/completions: one or more prompts (text or token ids), n samples each, then OpenAI's
text_completion body or its stream (choice index = prompt index x n + sample index).

Legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset) cover the returned text:
with echo, the prompt's tokens first (the first one has no logprob: null), then the generated
ones; text_offset is each token's character offset in the choice's text, continued across a
stream's chunks. echo with max_tokens 0 scores a prompt without generating (lm-eval-harness's
loglikelihood requests). vLLM's extras: prompt_logprobs and return_token_ids (token_ids,
prompt_token_ids) on each choice, stop_reason too."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.server.errors import APIError
from engine.server.limits import check_prompt_count, check_samples, check_sampling
from engine.server.protocol import CompletionRequest
from engine.server.serving_engine import (
    DONE,
    OpenAIServing,
    chain,
    finite_logprob,
    first_output,
    last_output,
)

# (token ids, their logprob entries (None: no logprob), offset of the first one in the text)
LogprobsPart = tuple[list[int], list[TokenLogprobs | None], int]


@dataclass(slots=True)
class _Sent:
    """What a stream has sent of one choice."""

    chars: int = 0  # characters of text, the echoed prompt included
    text: int = 0  # characters of the sample's own text (CompletionOutput.text)
    tokens: int = 0  # generated tokens
    started: bool = False


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        check_sampling(body, self.limits)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "invalid_request_error", "prompt")
        check_prompt_count(len(prompts), self.limits)
        check_samples(body.n * len(prompts), self.limits)
        for p in prompts:
            self.check_length(len(p), "prompt")
        params = await asyncio.to_thread(body.to_sampling_params)
        # Tokenizing runs on a worker thread: neither the event loop nor the engine waits.
        encoded = await asyncio.to_thread(lambda: [self.engine.encode_prompt(p) for p in prompts])
        rid = f"cmpl-{uuid.uuid4().hex}"
        encoded = self.truncate(encoded, body.truncate_prompt_tokens)
        streams = self.submit(rid, encoded, params, priority=body.priority)

        async def work():
            firsts = [await first_output(s) for s in streams]
            if body.stream:
                return self.stream_response(self._stream(rid, body, firsts, streams), streams)
            finals = await asyncio.gather(*(last_output(f, s) for f, s in zip(firsts, streams)))
            for final in finals:
                self.metrics.observe_finished(final)
            return self._response(rid, body, finals)

        return await self.respond(request, work(), streams)

    def _choice(
        self, index: int, body: CompletionRequest, final: RequestOutput, o: CompletionOutput
    ) -> dict:
        prompt = self.prompt_text(final) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            parts = [self._generated_part(o, 0, len(prompt))]
            if body.echo:
                parts.insert(0, self._prompt_part(final))
            logprobs = self.completion_logprobs(parts)
        choice = {
            "index": index,
            "text": prompt + o.text,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        # echo with logprobs computes them too; they are shown only when asked for.
        if body.prompt_logprobs is not None and final.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_json(final)
        return self._token_ids(choice, body, final, o.token_ids, with_prompt=True)

    def _token_ids(
        self,
        choice: dict,
        body: CompletionRequest,
        out: RequestOutput,
        token_ids: list[int],
        with_prompt: bool,
    ) -> dict:
        """vLLM's return_token_ids: the choice's token_ids, and prompt_token_ids (in a stream
        only on a choice's first chunk)."""
        if body.return_token_ids:
            if with_prompt:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = list(token_ids)
        return choice

    def _prompt_part(self, out: RequestOutput) -> LogprobsPart:
        ids = list(out.prompt_token_ids)
        return ids, _aligned(out.prompt_logprobs, len(ids)), 0

    def _generated_part(self, o: CompletionOutput, start: int, offset: int) -> LogprobsPart:
        """Generated tokens start.. of one sample, the first at character `offset`."""
        ids = list(o.token_ids[start:])
        return ids, _aligned((o.logprobs or [])[start:], len(ids)), offset

    def completion_logprobs(self, parts: list[LogprobsPart]) -> dict:
        """OpenAI's legacy logprobs object over consecutive runs of tokens."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_ids, entries, offset in parts:
            for token_id, entry in zip(token_ids, entries, strict=True):
                text = self.token_text(token_id)
                tokens.append(text)
                text_offset.append(offset)
                offset += len(text)
                if entry is None:
                    token_logprobs.append(None)
                    top_logprobs.append(None)
                    continue
                token_logprobs.append(finite_logprob(entry[token_id]))
                top_logprobs.append(
                    {self.token_text(t): finite_logprob(v) for t, v in entry.items()}
                )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

    def _response(self, rid: str, body: CompletionRequest, finals: list[RequestOutput]) -> dict:
        n = body.n
        choices = [
            self._choice(i * n + o.index, body, f, o)
            for i, f in enumerate(finals)
            for o in f.outputs
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "usage": self.usage(finals),
        }

    async def _stream(
        self,
        rid: str,
        body: CompletionRequest,
        firsts: list[RequestOutput],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in chain(firsts[i], streams[i]):
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader below
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        sent: dict[tuple[int, int], _Sent] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            running = len(tasks)
            while running:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out is None:
                    running -= 1
                    continue
                finals[i] = out
                choices = [
                    choice
                    for o in out.outputs
                    if (choice := self._stream_choice(body, i, out, o, sent)) is not None
                ]
                if choices:
                    data = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.served_model_name,
                        "choices": choices,
                    }
                    yield f"data: {json.dumps(data)}\n\n"
            for final in finals.values():
                self.metrics.observe_finished(final)
            if body.include_usage:
                data = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.served_model_name,
                    "choices": [],
                    "usage": self.usage([finals[i] for i in sorted(finals)]),
                }
                yield f"data: {json.dumps(data)}\n\n"
            yield DONE
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                await s.aclose()

    def _stream_choice(
        self,
        body: CompletionRequest,
        i: int,
        out: RequestOutput,
        o: CompletionOutput,
        sent: dict[tuple[int, int], _Sent],
    ) -> dict | None:
        """The chunk's choice for what sample o added since the last one (None: nothing yet).
        A choice's first chunk carries the echoed prompt, its logprobs and prompt_token_ids."""
        state = sent.setdefault((i, o.index), _Sent())
        first = not state.started
        prompt = self.prompt_text(out) if body.echo and first else ""
        delta = o.text[state.text :]
        if not prompt and not delta and o.finish_reason is None:
            return None  # tokens whose text is held back (a possible stop string) wait with it
        logprobs = None
        if body.logprobs is not None:
            parts = [self._generated_part(o, state.tokens, state.chars + len(prompt))]
            if prompt:
                parts.insert(0, self._prompt_part(out))
            logprobs = self.completion_logprobs(parts)
        choice = {
            "index": i * body.n + o.index,
            "text": prompt + delta,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        choice = self._token_ids(choice, body, out, o.token_ids[state.tokens :], with_prompt=first)
        state.started = True
        state.chars += len(prompt) + len(delta)
        state.text, state.tokens = len(o.text), len(o.token_ids)
        return choice


def _aligned(entries: list[TokenLogprobs | None] | None, count: int) -> list[TokenLogprobs | None]:
    """count entries, one per token: None where the engine recorded none."""
    entries = list(entries or [])[:count]
    return entries + [None] * (count - len(entries))
