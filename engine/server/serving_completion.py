"""POST /v1/completions: one or more prompts (text or token ids), n samples each, then OpenAI's
text_completion body or its stream (choice index = prompt index x n + sample index)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from engine.outputs import CompletionOutput, RequestOutput
from engine.server.errors import APIError
from engine.server.limits import check_prompt_count, check_samples, check_sampling
from engine.server.protocol import CompletionRequest
from engine.server.serving_engine import DONE, OpenAIServing, chain, first_output, last_output


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
        streams = self.submit(rid, encoded, params)

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
        text = (self.prompt_text(final) if body.echo else "") + o.text
        logprobs = None
        if o.logprobs is not None:
            logprobs = {
                "tokens": [self.token_text(t) for t in o.token_ids],
                "token_logprobs": [lp.get(t) for t, lp in zip(o.token_ids, o.logprobs)],
                "top_logprobs": [
                    {self.token_text(t): v for t, v in lp.items()} for lp in o.logprobs
                ],
                "text_offset": [],
            }
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
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
            "model": body.model,
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
        sent = {}
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
                choices = []
                for o in out.outputs:
                    key = (i, o.index)
                    prev = sent.get(key, "")
                    delta = o.text[len(prev) :]
                    if body.echo and key not in sent:
                        delta = self.prompt_text(out) + delta
                    if not delta and o.finish_reason is None:
                        continue
                    sent[key] = o.text
                    choices.append(
                        {
                            "index": i * body.n + o.index,
                            "text": delta,
                            "logprobs": None,
                            "finish_reason": o.finish_reason,
                        }
                    )
                if choices:
                    data = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": body.model,
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
                    "model": body.model,
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
