"""POST /v1/embeddings: each input's final hidden state pooled (engine/pooling.py), as OpenAI's
embedding list. Inputs are prefill-only requests on the generation path: admitted together
against --max-waiting-requests, batched with whatever else runs.

The vector comes as JSON floats, or with encoding_format "base64" as OpenAI sends it: the
float32 values, little-endian, base64-encoded (the openai client asks for this by default and
decodes it itself)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np
from fastapi import Request

from engine.outputs import RequestOutput
from engine.pooling import PoolingParams, PoolingType
from engine.sampling_params import SamplingParams
from engine.server.errors import APIError
from engine.server.protocol_embedding import EmbeddingRequest
from engine.server.serving_engine import OpenAIServing, first_output, last_output

# Nothing is sampled: the parameters only say "compute the prompt, generate nothing".
_PREFILL_ONLY = SamplingParams(max_tokens=0, temperature=0.0)


class OpenAIServingEmbedding(OpenAIServing):
    prompt_field = "input"

    def __init__(self, *args, pooling_type: PoolingType = "last") -> None:
        super().__init__(*args)
        PoolingParams(pooling_type)  # an unknown type fails at start, not per request
        self.pooling_type = pooling_type

    async def create(self, body: EmbeddingRequest, request: Request):
        self.check_model(body.model)
        inputs = body.inputs()
        if len(inputs) > self.limits.max_prompts:
            raise APIError(
                400,
                f"input: {len(inputs)} inputs is over this server's limit of "
                f"{self.limits.max_prompts}",
                param="input",
                code="limit_exceeded",
            )
        pooling = self._pooling(body)
        for text in inputs:
            if isinstance(text, str):
                self.check_length(len(text), "input")
        # Tokenizing runs on a worker thread: neither the event loop nor the engine waits.
        encoded = await asyncio.to_thread(self._encode, inputs, body.add_special_tokens)
        prompts = self.truncate([(ids, None) for ids in encoded], body.truncate_prompt_tokens)
        several = isinstance(body.input, list) and not all(isinstance(t, int) for t in body.input)
        for i, (ids, _) in enumerate(prompts):
            self._check_tokens(ids, f"input[{i}]" if several else "input")
        rid = f"embd-{uuid.uuid4().hex}"
        streams = self.admit(
            rid, prompts, _PREFILL_ONLY, priority=body.priority, pooling=pooling, param="input"
        )

        async def work():
            firsts = [await first_output(s) for s in streams]
            finals = await asyncio.gather(*(last_output(f, s) for f, s in zip(firsts, streams)))
            for final in finals:
                self.metrics.observe_finished(final)
            return self._response(rid, body, finals)

        return await self.respond(request, work(), streams)

    def _pooling(self, body: EmbeddingRequest) -> PoolingParams:
        d, width = body.dimensions, self.info.hidden_size
        if d is not None and not 1 <= d <= width:
            raise APIError(
                400,
                f"dimensions must be between 1 and this model's embedding size {width}, got {d}",
                param="dimensions",
            )
        return PoolingParams(self.pooling_type, normalize=body.normalize, dimensions=d)

    def _encode(self, inputs: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        if self.tokenizer is None and any(isinstance(i, str) for i in inputs):
            raise APIError(
                400, "this model has no tokenizer: give input as token ids", param="input"
            )
        return [
            self.tokenizer.encode(i, add_special_tokens=add_special_tokens)
            if isinstance(i, str)
            else i
            for i in inputs
        ]

    def _check_tokens(self, ids: list[int], where: str) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", param=where
            )
        if not ids:  # a text that tokenizes to nothing (no special tokens asked for)
            raise APIError(
                400, f"{where}: a text gave no tokens; there is nothing to embed", param=where
            )
        # The whole input is the request: max_model_len, or less when the KV pool is smaller.
        limit = self.info.max_request_tokens
        if len(ids) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the "
                "length of the input.",
                param=where,
                code="context_length_exceeded",
            )

    def _response(self, rid: str, body: EmbeddingRequest, finals: list[RequestOutput]) -> dict:
        data = [
            {"index": i, "object": "embedding", "embedding": _encoded(f, body.encoding_format)}
            for i, f in enumerate(finals)
        ]
        tokens = sum(len(f.prompt_token_ids) for f in finals)
        return {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": self.served_model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _encoded(final: RequestOutput, encoding_format: str) -> list[float] | str:
    if final.embedding is None:  # pragma: no cover - a finished pooling request has one
        raise RuntimeError(f"request {final.request_id} finished without an embedding")
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(final.embedding, dtype="<f4").tobytes()).decode()
    return final.embedding
