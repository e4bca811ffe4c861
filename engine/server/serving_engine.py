"""What every generating endpoint shares (vLLM's OpenAIServing): the model check, the length
bound, atomic admission against --max-waiting-requests, awaiting a response while the client is
there, ending every stream with `data: [DONE]`, and the pieces of OpenAI's response bodies that
chat and completions have in common (usage, token text)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.async_engine import AsyncEngine, RequestStream
from engine.outputs import RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.server.disconnect import ClientDisconnected, until_disconnected
from engine.server.errors import APIError, as_api_error, sse_error
from engine.server.limits import RequestLimits
from engine.server.metrics import ServerMetrics
from engine.server.token_bytes import TokenBytes

DONE = "data: [DONE]\n\n"


class OpenAIServing:
    # The request field that holds the prompt, as errors name it: "messages" for chat.
    prompt_field = "prompt"

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        metrics: ServerMetrics,
        limits: RequestLimits,
        max_waiting_requests: int | None,
        *,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        self.info = engine.info
        self.tokenizer = engine.info.tokenizer
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.limits = limits
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = engine.info.max_model_len
        self.token_bytes = TokenBytes(self.tokenizer)  # a token's own bytes (chat logprobs)
        # No prompt longer than this can fit, whatever it says: no token covers more characters.
        self.max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer)

    def check_request_template(self, template: str | None) -> None:
        """A request's own chat_template runs only on a server told to trust its callers (vLLM's
        --trust-request-chat-template): Jinja's sandbox bounds each loop, not nested ones, so one
        template can spin a worker thread for hours, slowing every request and holding up
        shutdown, and no thread can be stopped from outside."""
        if template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template: this server does not run chat templates sent with requests "
                "(start it with --trust-request-chat-template to allow them); leave the field out "
                "to use the model's own template",
                param="chat_template",
            )

    def check_model(self, name: str | None) -> None:
        """The requested model; None (the field left out) means the served one, as in vLLM."""
        if name is not None and name != self.served_model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.served_model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_length(self, chars: int, field: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your {field} has {chars} characters, more than {self.max_model_len} tokens can "
                f"hold (refused before tokenizing).",
                param=field,
                code="context_length_exceeded",
            )

    def check_context(
        self, prompt_ids: list[int], max_tokens: int | None, max_field: str = "max_tokens"
    ) -> None:
        """Prompt + completion within the context, refused in OpenAI's words (clients such as
        LiteLLM recognise "This model's maximum context length is" and the code, and raise their
        context-window error). The engine checks again, as the last line of defence."""
        limit = self.info.max_request_tokens  # max_model_len, or less when the KV pool is smaller
        field = self.prompt_field
        p = len(prompt_ids)
        if max_tokens is not None and max_tokens >= limit:
            # Too large whatever the prompt: the field the caller sent is at fault (vLLM's words).
            raise APIError(
                400,
                f"'{max_field}' is too large: {max_tokens}. This model's maximum context length "
                f"is {limit} tokens and your request has {p} input tokens ({max_tokens} > "
                f"{limit} - {p}).",
                param=max_field,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            if p < limit:
                return  # the completion may take the rest
            detail = f"your {field} resulted in {p} tokens, leaving no room for the completion"
        elif p + max_tokens <= limit:
            return
        else:
            detail = (
                f"you requested {p + max_tokens} tokens ({p} in the {field}, {max_tokens} in the "
                "completion)"
            )
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, {detail}. Please "
            f"reduce the length of the {field} or completion.",
            param=field,
            code="context_length_exceeded",
        )

    def check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids the request names (logit_bias keys, stop_token_ids) exist in the model."""
        vocab = self.info.vocab_size
        for field, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise APIError(
                    400,
                    f"{field}: token id {outside[0]} is outside the vocabulary [0, {vocab})",
                    param=field,
                )

    def submit(
        self,
        rid: str,
        prompts: list[tuple[list[int], str | None]],
        params: SamplingParams,
        *,
        priority: int = 0,
        max_field: str = "max_tokens",
    ) -> list[RequestStream]:
        """Admit the prompts' samples at once, after the checks that need the tokens (context
        length) or the model (logit_bias and stop_token_ids in its vocabulary). max_field: the
        request's name for max_tokens, which errors name."""
        self.check_vocabulary(params)
        for ids, _ in prompts:
            self.check_context(ids, params.max_tokens, max_field)
        return self.admit(rid, prompts, params, priority=priority)

    def admit(
        self,
        rid: str,
        prompts: list[tuple[list[int], str | None]],
        params: SamplingParams,
        *,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        param: str = "n",
    ) -> list[RequestStream]:
        """Hand the prompts to the engine together, or refuse them all (a full waiting queue is
        a 429, counted in the rejected metric). param: the field a too-large request names."""
        samples = params.n * len(prompts)
        limit = self.max_waiting_requests
        if limit is not None and samples > limit:
            # Every admitted sample waits until the scheduler takes it: more than the limit
            # would overflow the queue even when it is empty.
            what = f"{samples} inputs" if param == "input" else f"n x prompts = {samples} samples"
            raise APIError(
                400,
                f"{param}: {what}, over this server's waiting limit of {limit} (set by "
                "--max-waiting-requests), so it is never admitted",
                param=param,
                code="limit_exceeded",
            )
        try:
            return self.engine.submit_many(
                [
                    (f"{rid}-{i}" if len(prompts) > 1 else rid, ids, text)
                    for i, (ids, text) in enumerate(prompts)
                ],
                params,
                priority,
                max_waiting=limit,
                pooling=pooling,
            )
        except Exception as e:
            self.metrics.rejected.labels(as_api_error(e).code or "error").inc()
            raise

    def truncate(
        self, prompts: list[tuple[list[int], str | None]], keep: int | None
    ) -> list[tuple[list[int], str | None]]:
        """vLLM's truncate_prompt_tokens: keep each prompt's last `keep` tokens (-1: as many as
        the context holds). A cut prompt's text is dropped, so echo decodes what was kept."""
        if keep is None:
            return prompts
        if keep == -1:
            keep = self.info.max_request_tokens
        if keep > self.max_model_len:
            raise APIError(
                400,
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                f"({self.max_model_len}); give at most that, or -1 for as many as fit",
                param="truncate_prompt_tokens",
            )
        if keep < 1:
            raise APIError(
                400,
                f"truncate_prompt_tokens must be -1 or an integer >= 1, got {keep}",
                param="truncate_prompt_tokens",
            )
        return [(ids, text) if len(ids) <= keep else (ids[-keep:], None) for ids, text in prompts]

    async def respond(self, request: Request, work: Awaitable, streams: list[RequestStream]):
        """Await the response while the client is there; a client gone aborts the request.
        Unless a stream's response takes them over, the request streams end here."""
        result = None
        try:
            result = await until_disconnected(request, work)
            return result
        except ClientDisconnected:
            self.metrics.aborted.labels("client_disconnect").inc(_samples(streams))
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except Exception as e:
            self.metrics.count_failure(e, _samples(streams))
            raise
        finally:
            if not isinstance(result, StreamingResponse):
                for s in streams:
                    await s.aclose()

    def stream_response(
        self, events: AsyncIterator[str], streams: list[RequestStream]
    ) -> StreamingResponse:
        return StreamingResponse(
            self._guarded(events, streams),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _guarded(self, events: AsyncIterator[str], streams: list[RequestStream]):
        """Every stream ends with `data: [DONE]`: after its last chunk, or after an error event
        when the engine fails it (or shuts down) mid-way. A client gone aborts the request."""
        ended = False
        try:
            async for event in events:
                yield event
            ended = True
        except Exception as e:  # noqa: BLE001 - reported to the client, in OpenAI's shape
            self.metrics.count_failure(e, _samples(streams))
            ended = True
            yield sse_error(e)
            yield DONE
        finally:
            if not ended:
                self.metrics.aborted.labels("client_disconnect").inc(_samples(streams))
            for s in streams:
                await s.aclose()

    def prompt_text(self, out: RequestOutput) -> str:
        """What echo repeats: the prompt's text, decoded when it came as token ids."""
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def prompt_logprobs_json(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's prompt_logprobs (a choice's in completions, the response's in chat): per prompt
        position, {token id: {"logprob", "rank", "decoded_token"}} for the prompt token and the
        top k; null for the first position, which has no context."""
        if out.prompt_logprobs is None:
            return None
        return [
            None if entry is None else self.ranked_logprobs(entry) for entry in out.prompt_logprobs
        ]

    def ranked_logprobs(self, entry: dict[int, float]) -> dict[str, dict]:
        """One position's logprobs with vLLM's rank (1 = most likely). The first key is the
        prompt (or sampled) token, whose exact rank the sampler records; the others are the top
        k, each ranked by the entries above it (none outside the top k can be)."""
        first = next(iter(entry), None)
        exact = getattr(entry, "rank", None)
        out = {}
        for token, logprob in entry.items():
            rank = 1 + sum(v > logprob for v in entry.values())
            if token == first and exact is not None:
                rank = exact
            out[str(token)] = {
                "logprob": finite_logprob(logprob),
                "rank": rank,
                "decoded_token": self.token_text(token),
            }
        return out

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id])

    def usage(self, finals: list[RequestOutput]) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
        cached = sum(f.metrics.num_cached_tokens for f in finals)
        # No completion_tokens_details for speculation's drafts: OpenAI's prediction tokens are
        # Predicted Outputs, billed as completion tokens, which drafts are not; vLLM sends none
        # either, so a response is the same with speculation or without (drafts: /metrics).
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


async def first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output; raises the request's ValueError (a 400) before any byte is sent."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration as e:  # pragma: no cover - the engine always sends one
        raise RuntimeError("engine returned no output") from e


async def chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def last_output(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = first
    async for out in chain(first, rest):
        final = out
    return final


def finite_logprob(logprob: float) -> float:
    """-inf as OpenAI and vLLM send it, -9999.0: JSON has no infinity."""
    return max(logprob, -9999.0)


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (from its UTF-8 length in the vocabulary, an
    upper bound for byte-level and sentencepiece vocabularies alike); 64 without a tokenizer,
    whose prompts are token ids anyway."""
    if tokenizer is None:
        return 64
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)


def _samples(streams: list[RequestStream]) -> int:
    """The engine requests a call's streams stand for: the unit of the request metrics."""
    return sum(s.num_samples for s in streams)
