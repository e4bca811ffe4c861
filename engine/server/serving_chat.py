"""POST /v1/chat/completions: messages (with tools, tool calls and tool results) rendered by the
chat template, then OpenAI's chat.completion body or its chat.completion.chunk stream.

Tool calls: "required" and named functions are forced by a structured-output constraint built
from the tools' schemas; "auto" reads calls out of the text with the model family's parser
(--tool-call-parser, or the one the chat template's markers call for). Either way each choice's
text goes through a reader (tool_choice.py) that turns it into content and calls, fed the same
deltas whether the answer streams or not. finish_reason is "tool_calls" where calls were
chosen by the model ("auto", "required"), "stop" for a named function (OpenAI's rule), and
"length" whenever the answer was cut short. The legacy functions API answers with
message.function_call and finish_reason "function_call"."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from engine.outputs import CompletionOutput, RequestOutput
from engine.server.errors import APIError
from engine.server.limits import check_sampling
from engine.server.protocol_chat import ChatCompletionRequest, ToolSetup
from engine.server.serving_engine import (
    DONE,
    OpenAIServing,
    chain,
    finite_logprob,
    first_output,
    last_output,
)
from engine.server.tool_choice import (
    AutoCalls,
    CallDelta,
    NamedCall,
    Piece,
    PlainText,
    RequiredCalls,
    collect,
)
from engine.server.tool_parsers import detect_parser, parser_class
from engine.tokenizer import template_text

Reader = PlainText | NamedCall | RequiredCalls | AutoCalls


class OpenAIServingChat(OpenAIServing):
    prompt_field = "messages"

    def __init__(self, *args, tool_call_parser: str | None = None, **options) -> None:
        super().__init__(*args, **options)
        if tool_call_parser is not None:
            parser_class(tool_call_parser)  # an unknown name fails at start, not per request
        self.tool_call_parser = tool_call_parser

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        self.check_request_template(body.chat_template)
        check_sampling(body, self.limits)
        setup = body.tool_setup()
        messages = body.template_messages()
        new_reader = self._readers(body, setup)
        # Every message renders to at least one token, every token to at most so many chars.
        extra = json.dumps([setup.tools, body.documents, [m.get("tool_calls") for m in messages]])
        self.check_length(sum(len(m["content"]) for m in messages) + len(extra), "messages")
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
        prompt_ids = await asyncio.to_thread(
            self.engine.encode_chat,
            messages,
            tools=setup.tools,
            documents=body.documents,
            chat_template=body.chat_template,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.template_kwargs(),
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompts = self.truncate([(prompt_ids, None)], body.truncate_prompt_tokens)
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else None
        streams = self.submit(
            rid, prompts, params, priority=body.priority, max_field=max_field or "max_tokens"
        )

        async def work():
            first = await first_output(streams[0])
            if body.stream:
                events = self._stream(rid, body, setup, new_reader, first, streams[0])
                return self.stream_response(events, streams)
            final = await last_output(first, streams[0])
            self.metrics.observe_finished(final)
            return self._response(rid, body, setup, new_reader, final)

        return await self.respond(request, work(), streams)

    def _readers(self, body: ChatCompletionRequest, setup: ToolSetup) -> Callable[[], Reader]:
        """How each choice's text is read, by tool_choice; refuses what cannot be honoured,
        tools or documents among them that the template would silently leave out."""
        template = template_text(self.tokenizer, body.chat_template) if self.tokenizer else ""
        if body.documents is not None and "documents" not in template:
            raise APIError(
                400,
                "the chat template never renders documents, so the model would not see them; "
                "give a chat_template that does, or leave documents out",
                param="chat_template" if body.chat_template else "documents",
            )
        if setup.tools is None:
            return PlainText
        # "none", "required" and a named function hold whatever the template shows: the
        # grammar carries the tools' schemas itself (as in vLLM). Only "auto" needs the model
        # to have seen the tools, since it decides alone whether to call one.
        if setup.named is not None:
            return lambda: NamedCall(setup.named)
        if setup.choice == "required":
            return RequiredCalls
        if setup.choice == "none":
            return PlainText
        if "tools" not in template:
            field = (
                "chat_template"
                if body.chat_template
                else "functions"
                if body.functions
                else "tools"
            )
            raise APIError(
                400,
                'tool_choice "auto": the chat template never renders tools, so the model would '
                'not know them; give a chat_template that does, or use tool_choice "required" '
                "or a named function (enforced whatever the template)",
                param=field,
            )
        name = self.tool_call_parser or detect_parser(template)
        if name is None:
            raise APIError(
                400,
                'tool_choice "auto" needs a tool-call parser, and this model\'s chat template '
                "shows no known call format: start the server with --tool-call-parser "
                '(hermes, llama3_json, mistral), or use tool_choice "required" or a named '
                "function",
                param="tool_choice",
            )
        parser = parser_class(name)
        return lambda: AutoCalls(parser(), setup.parallel)

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
                    "logprob": finite_logprob(lp[token_id]),
                    "bytes": self.token_bytes(token_id),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": finite_logprob(v),
                            "bytes": self.token_bytes(t),
                        }
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    def _response(
        self,
        rid: str,
        body: ChatCompletionRequest,
        setup: ToolSetup,
        new_reader: Callable[[], Reader],
        final: RequestOutput,
    ) -> dict:
        choices = []
        for o in final.outputs:
            reader = new_reader()
            content, calls = collect(reader.feed(o.text) + reader.finish())
            message: dict = {"role": "assistant", "content": content}
            if calls:
                message["content"] = content or None
                if setup.legacy:
                    message["function_call"] = {
                        "name": calls[0].name,
                        "arguments": calls[0].arguments,
                    }
                else:
                    message["tool_calls"] = [
                        {
                            "id": _call_id(),
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in calls
                    ]
            choice = {
                "index": o.index,
                "message": message,
                "logprobs": self._logprobs(o, 0, body.top_logprobs or 0),
                "finish_reason": _finish_reason(o.finish_reason, setup, bool(calls)),
                "stop_reason": o.stop_reason,
            }
            if body.return_token_ids:
                choice["token_ids"] = list(o.token_ids)
            choices.append(choice)
        response = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "usage": self.usage([final]),
        }
        # vLLM's extras, at the top level in chat (the prompt is shared by every choice).
        if final.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs_json(final)
        if body.return_token_ids:
            response["prompt_token_ids"] = list(final.prompt_token_ids)
        return response

    async def _stream(
        self,
        rid: str,
        body: ChatCompletionRequest,
        setup: ToolSetup,
        new_reader: Callable[[], Reader],
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[dict], extra: dict | None = None) -> str:
            data = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.served_model_name,
                "choices": choices,
                **(extra or {}),
            }
            return f"data: {json.dumps(data)}\n\n"

        count = len(first.outputs)
        readers = [new_reader() for _ in range(count)]
        call_ids: list[dict[int, str]] = [{} for _ in range(count)]
        sent_text = [""] * count
        sent_tokens = [0] * count
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(count)
            ],
            {"prompt_token_ids": list(first.prompt_token_ids)} if body.return_token_ids else None,
        )
        final = first
        async for out in chain(first, outputs):
            final = out
            for o in out.outputs:
                i = o.index
                reader = readers[i]
                pieces = reader.feed(o.text[len(sent_text[i]) :])
                sent_text[i] = o.text
                if o.finish_reason is not None:
                    pieces += reader.finish()
                deltas = [_delta(p, setup.legacy, call_ids[i]) for p in pieces]
                reason = None
                if o.finish_reason is not None:
                    reason = _finish_reason(o.finish_reason, setup, reader.num_calls > 0)
                    deltas.append({})
                elif not deltas:
                    continue  # held back (a marker may be starting): the tokens' logprobs wait
                for n, delta in enumerate(deltas):
                    last = n == len(deltas) - 1
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": reason if last else None,
                    }
                    if last and o.finish_reason is not None:
                        choice["stop_reason"] = o.stop_reason
                    if n == 0:  # the tokens since the last chunk, held-back ones included
                        start = sent_tokens[i]
                        choice["logprobs"] = self._logprobs(o, start, body.top_logprobs or 0)
                        if body.return_token_ids:
                            choice["token_ids"] = list(o.token_ids[start:])
                        sent_tokens[i] = len(o.token_ids)
                    yield chunk([choice])
        if final.finished:
            self.metrics.observe_finished(final)
        if body.include_usage:
            yield chunk([], {"usage": self.usage([final])})
        yield DONE


def _delta(piece: Piece, legacy: bool, ids: dict[int, str]) -> dict:
    """One piece as a chunk's delta, in OpenAI's streaming shape: a call's first delta has its
    index, id, type and name with empty arguments; later ones only index and arguments."""
    if not isinstance(piece, CallDelta):
        return {"content": piece}
    function: dict = {"arguments": piece.arguments}
    if piece.name is not None:
        function = {"name": piece.name, "arguments": piece.arguments}
    if legacy:
        return {"function_call": function}
    call: dict = {"index": piece.index}
    if piece.name is not None:
        ids[piece.index] = _call_id()
        call |= {"id": ids[piece.index], "type": "function"}
    return {"tool_calls": [call | {"function": function}]}


def _finish_reason(reason: str | None, setup: ToolSetup, called: bool) -> str | None:
    if reason != "stop" or not called or setup.named is not None:
        return reason  # a named function ends as "stop", as OpenAI's does
    return "function_call" if setup.legacy else "tool_calls"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
