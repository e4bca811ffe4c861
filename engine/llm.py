"""The offline API: LLM(...).generate(prompts, params) and .chat(conversations, params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | Path = "default", **options: Any) -> None:
        """`model`: "default" or a local HF folder; `options`: any EngineConfig field
        (dtype, device, block_size, num_kv_blocks, kv_cache_memory, gpu_memory_utilization,
        max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching, seed,
        profile_path, num_threads, attention_backend, enforce_eager, speculative,
        num_speculative_tokens, draft_model, prompt_lookup_min, prompt_lookup_max,
        tensor_parallel_size, quantization, quant_group_size, kv_cache_dtype)."""
        config = EngineConfig(model=str(model), **options)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._shut_down = False

    def shutdown(self) -> None:
        """Stop what the engine started (tensor-parallel worker processes); idempotent. The
        workers also end with this process. Nothing can be generated afterwards."""
        self._shut_down = True
        self.engine.core.shutdown()

    def spec_decode_stats(self) -> dict:
        """Speculative decoding so far: drafts, proposed and accepted tokens, acceptance rate,
        mean acceptance length, accepted count per draft position (all zero without it)."""
        return self.engine.core.spec_stats.as_dict()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        return self._run(
            [self.engine.encode_prompt(p) for p in prompt_list], sampling_params, priority
        )

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[RequestOutput]:
        """Each prompt's final hidden state pooled (last token, L2-normalized by default), in
        RequestOutput.embedding; prefill-only requests through the same scheduler as generation."""
        prompt_list = _as_prompt_list(prompts)
        return self._run(
            [self.engine.encode_prompt(p) for p in prompt_list],
            SamplingParams(max_tokens=0),
            pooling=pooling or PoolingParams(),
        )

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        return self._run([(None, self.engine.encode_chat(list(c))) for c in convs], sampling_params)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None = None,
        pooling: PoolingParams | None = None,
    ) -> list[RequestOutput]:
        if self._shut_down:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown()): make a new one")
        params = _per_prompt(sampling_params, len(prompts))
        ids: list[str] = []
        try:
            for i, ((_, token_ids), sp) in enumerate(zip(prompts, params)):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(
                    request_id,
                    token_ids,
                    sp,
                    priority=priority[i] if priority else 0,
                    pooling=pooling,
                )
                ids.append(request_id)
        except ValueError:
            for request_id in ids:  # all or nothing: the engine is left as it was
                self.engine.abort(request_id)
            raise
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            # A failed step must not leave its requests holding blocks for every later call.
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        results = [finals[i] for i in ids]
        for (text, _), result in zip(prompts, results):
            result.prompt = text
        return results


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
