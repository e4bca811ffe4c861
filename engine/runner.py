"""ModelRunner: turns a SchedulerOutput into one flattened batch, runs one forward, returns logits.

Only the rows that sample (a request whose scheduled chunk reaches its last token) go through the
output projection: with a 49152-token vocabulary that projection is the largest matmul of the
model, and prompt positions do not need it (unless prompt logprobs were asked for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaModel
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from engine.cuda_graphs import CudaGraphRunner


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
        self.graphs: CudaGraphRunner | None = None  # set by capture_cuda_graphs (GPU only)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # Decodes (one query token) first, by context length: the attention backend batches runs
        # of similar length; prefill chunks follow, each attended on its own.
        items = sorted(
            sched.scheduled,
            key=lambda s: (s.num_tokens != 1, s.request.num_computed_tokens),
        )
        if self._graph_step(items):
            return self._execute_graph(items)
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

    def _graph_step(self, items: list[ScheduledRequest]) -> bool:
        """A decode-only step that a captured CUDA graph can run."""
        return (
            self.graphs is not None
            and len(items) <= self.graphs.max_batch
            and all(s.num_tokens == 1 and s.samples for s in items)
            and all(s.request.params.prompt_logprobs is None for s in items)
        )

    def _execute_graph(self, items: list[ScheduledRequest]) -> RunnerOutput:
        bs = self.block_size
        token_ids, positions, slots, tables, seq_lens = [], [], [], [], []
        for s in items:
            req = s.request
            position = req.num_computed_tokens
            table = self.kv.block_ids(req.request_id)
            token_ids.append(req.token_slice(position, position + 1)[0])
            positions.append(position)
            slots.append(table[position // bs] * bs + position % bs)
            tables.append(table)
            seq_lens.append(position + 1)
        assert self.graphs is not None
        logits = self.graphs.run(token_ids, positions, slots, tables, seq_lens)
        return RunnerOutput(
            sample_requests=[s.request for s in items],
            logits=logits,
            prompt_logits={},
            num_context_tokens=sum(seq_lens),
        )

    def capture_cuda_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        from engine.cuda_graphs import CudaGraphRunner

        self.graphs = CudaGraphRunner(
            self.model, self.kv_caches, self.block_size, max_model_len, max_num_seqs
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
