"""POST /v1/chat/completions: messages rendered by the model's chat template, then OpenAI's
chat.completion body or its chat.completion.chunk stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from engine.outputs import CompletionOutput, RequestOutput
from engine.server.errors import APIError
from engine.server.limits import check_sampling
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.serving_engine import DONE, OpenAIServing, chain, first_output, last_output


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tool_call_parser: str | None = None) -> None:
        super().__init__(*args)
        self.tool_call_parser = tool_call_parser

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        check_sampling(body, self.limits)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        # Every message renders to at least one token, every token to at most so many chars.
        self.check_length(sum(len(m["content"]) for m in messages), "messages")
        if len(messages) > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your messages are {len(messages)}, each at least one token.",
                param="messages",
                code="context_length_exceeded",
            )
        # Compiling a structured-output constraint can take a while: not on the event loop.
        params = await asyncio.to_thread(body.to_sampling_params)
        # Rendering and tokenizing run on a worker thread: neither the event loop nor the
        # engine's steps wait for them.
        prompt_ids = await asyncio.to_thread(self.engine.encode_chat, messages)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.submit(rid, [(prompt_ids, None)], params)

        async def work():
            first = await first_output(streams[0])
            if body.stream:
                return self.stream_response(self._stream(rid, body, first, streams[0]), streams)
            final = await last_output(first, streams[0])
            self.metrics.observe_finished(final)
            return self._response(rid, body, final)

        return await self.respond(request, work(), streams)

    def _logprobs(self, out: CompletionOutput, start: int, k: int) -> dict | None:
        """OpenAI's chat logprobs for tokens start.. of one choice (top k alternatives each)."""
        if out.logprobs is None:
            return None
        content = []
        for token_id, lp in zip(out.token_ids[start:], out.logprobs[start:]):
            top = sorted(lp.items(), key=lambda item: -item[1])[:k]
            text = self.token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": lp[token_id],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": v,
                            "bytes": list(self.token_text(t).encode()),
                        }
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    def _response(self, rid: str, body: ChatCompletionRequest, final: RequestOutput) -> dict:
        choices = [
            {
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": self._logprobs(o, 0, body.top_logprobs or 0),
                "finish_reason": o.finish_reason,
            }
            for o in final.outputs
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": self.usage([final]),
        }

    async def _stream(
        self,
        rid: str,
        body: ChatCompletionRequest,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[dict], extra: dict | None = None) -> str:
            data = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": choices,
                **(extra or {}),
            }
            return f"data: {json.dumps(data)}\n\n"

        sent_text = [""] * len(first.outputs)
        sent_tokens = [0] * len(first.outputs)
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(first.outputs))
            ]
        )
        final = first
        async for out in chain(first, outputs):
            final = out
            choices = []
            for o in out.outputs:
                delta = o.text[len(sent_text[o.index]) :]
                if not delta and o.finish_reason is None:
                    continue
                choices.append(
                    {
                        "index": o.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": self._logprobs(o, sent_tokens[o.index], body.top_logprobs or 0),
                        "finish_reason": o.finish_reason,
                    }
                )
                sent_text[o.index], sent_tokens[o.index] = o.text, len(o.token_ids)
            if choices:
                yield chunk(choices)
        if final.finished:
            self.metrics.observe_finished(final)
        if body.include_usage:
            yield chunk([], {"usage": self.usage([final])})
        yield DONE
