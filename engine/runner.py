"""ModelRunner: turns a SchedulerOutput into one flattened batch, runs one forward, returns logits.

Only the rows that sample (a request whose scheduled chunk reaches its last token) go through the
output projection: with a 49152-token vocabulary that projection is the largest matmul of the
model, and prompt positions do not need it (unless prompt logprobs were asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaModel
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class RunnerOutput:
    sample_requests: list[Request]  # one per row of logits
    logits: torch.Tensor  # [len(sample_requests), vocab] float32
    # request id -> (first position, logits [n, vocab]) for chunks of requests that asked for
    # prompt logprobs; row j predicts the token at position first + j + 1
    prompt_logits: dict[str, tuple[int, torch.Tensor]]
    num_context_tokens: int  # sum over requests of the context attended this step


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheManager, num_blocks: int, block_size: int):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # Decodes (one query token) first, by context length: the attention backend batches runs
        # of similar length; prefill chunks follow, each attended on its own.
        items = sorted(
            sched.scheduled,
            key=lambda s: (s.num_tokens != 1, s.request.num_computed_tokens),
        )
        input_ids, positions, meta = self._prepare(items)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        sample_rows = [meta.query_start_loc[i + 1] - 1 for i, s in enumerate(items) if s.samples]
        logits = self.model.compute_logits(hidden[sample_rows])
        return RunnerOutput(
            sample_requests=[s.request for s in items if s.samples],
            logits=logits,
            prompt_logits=self._prompt_logits(items, hidden, meta),
            num_context_tokens=sum(meta.seq_lens_list),
        )

    def _prepare(
        self, items: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for s in items:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_tokens
            table = self.kv.block_ids(req.request_id)
            token_ids += req.token_slice(start, end)
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + s.num_tokens)
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        device = self.model.device
        meta = AttentionMetadata(
            num_decodes=sum(1 for s in items if s.num_tokens == 1),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc,
            seq_lens_list=seq_lens,
            block_size=bs,
        )
        return (
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
        )

    def _prompt_logits(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, meta: AttentionMetadata
    ) -> dict[str, tuple[int, torch.Tensor]]:
        out: dict[str, tuple[int, torch.Tensor]] = {}
        for i, s in enumerate(items):
            req = s.request
            if req.params.prompt_logprobs is None:
                continue
            first = req.num_computed_tokens
            # positions first .. last-1 predict prompt tokens first+1 .. num_prompt-1
            n = min(s.num_tokens, req.num_prompt_tokens - 1 - first)
            if n < 0 or (n == 0 and first > 0):
                continue  # past the prompt; a 1-token prompt still gets its [None] entry
            start = meta.query_start_loc[i]
            out[req.request_id] = (first, self.model.compute_logits(hidden[start : start + n]))
        return out
