"""ModelRunner: turns a SchedulerOutput into one flattened batch, runs one forward, returns logits.

Only the rows that sample (a request whose scheduled chunk reaches its last token) go through the
output projection: with a 49152-token vocabulary that projection is the largest matmul of the
model, and prompt positions do not need it (unless prompt logprobs were asked for). A decode that
verifies k proposed tokens yields k + 1 rows: the prediction after each of them and after its last
token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.attention.kv_quant import LayerKVCache, allocate_layer, kv_cache_format
from engine.attention.metadata import AttentionMetadata
from engine.models.llama import LlamaModel
from engine.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from engine.cuda_graphs import CudaGraphRunner


@dataclass(slots=True)
class BatchChunk:
    """Tokens one request computes in a forward: token_ids at positions start, start + 1, ..."""

    start: int
    token_ids: list[int]
    block_table: list[int]


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[ScheduledRequest]  # the chunks that yield logits, in row order
    logits: torch.Tensor  # [sum of their num_sample_rows, vocab] float32
    # request id -> (first position, logits [n, vocab]) for chunks of requests that asked for
    # prompt logprobs; row j predicts the token at position first + j + 1
    prompt_logits: dict[str, tuple[int, torch.Tensor]]
    num_context_tokens: int  # sum over requests of the context attended this step
    # request id -> (first position, hidden states [n, hidden] after the final norm) for chunks
    # of pooling requests: every row of the chunk, or for "last" pooling only the prompt's last
    # row, in the chunk that reaches it
    pooled_hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class StepInput:
    """One forward as every tensor-parallel rank runs it: the flattened batch, and the rows of
    its hidden states that go through the LM head (sampling rows first, then prompt-logprob
    rows). Plain tensors and lists: it is what rank 0 broadcasts to the other ranks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: list[int]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        broadcast: Callable[[StepInput], None] | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """broadcast: hands each step's input to the other tensor-parallel ranks before this
        rank runs it (they run the same forward: its collectives need every rank).
        kv_cache_dtype: auto (the model's dtype), fp8 or int8 (engine/attention/kv_quant.py)."""
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, kv_cache_dtype)
        self.broadcast = broadcast
        self.graphs: CudaGraphRunner | None = None  # set by capture_cuda_graphs (GPU only)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # Decodes (one query token) first, then by query length (a decode verifying k drafts has
        # 1 + k), each by context length: the attention backends batch runs of equal query length
        # and similar context; long prefill chunks are attended one by one.
        items = sorted(
            sched.scheduled,
            key=lambda s: (s.num_tokens != 1, s.num_tokens, s.request.num_computed_tokens),
        )
        if self._graph_step(items):
            return self._execute_graph(items)
        input_ids, positions, meta = prepare_batch(
            [self._chunk(s) for s in items], self.block_size, self.model.device
        )
        sample_rows = [
            row
            for i, s in enumerate(items)
            for row in range(
                meta.query_start_loc[i + 1] - s.num_sample_rows, meta.query_start_loc[i + 1]
            )
        ]
        prompt_rows = self._prompt_rows(items, meta)
        step = StepInput(
            input_ids,
            positions,
            meta,
            sample_rows + [r for _, _, rows in prompt_rows for r in rows],
        )
        if self.broadcast is not None:
            self.broadcast(step)
        hidden, logits = self.run(step)
        prompt_logits, offset = {}, len(sample_rows)
        for request_id, first, rows in prompt_rows:
            prompt_logits[request_id] = (first, logits[offset : offset + len(rows)])
            offset += len(rows)
        return RunnerOutput(
            sampled=[s for s in items if s.samples],
            logits=logits[: len(sample_rows)],
            prompt_logits=prompt_logits,
            num_context_tokens=sum(meta.seq_lens_list),
            pooled_hidden=self._pooled_hidden(items, hidden, meta),
        )

    def run(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward and the LM head over step.logit_rows: (hidden states, logits float32)."""
        hidden = self.model.forward(step.input_ids, step.positions, self.kv_caches, step.meta)
        if step.logit_rows:
            logits = self.model.compute_logits(hidden[step.logit_rows])
        else:  # only prefill-only requests, or unfinished prompts: nothing samples
            logits = torch.empty((0, self.model.config.vocab_size), device=hidden.device)
        return hidden, logits

    def _graph_step(self, items: list[ScheduledRequest]) -> bool:
        """A decode-only step that a captured CUDA graph can run."""
        return (
            self.graphs is not None
            and len(items) <= self.graphs.max_batch
            and all(s.num_tokens == 1 and s.samples for s in items)  # no proposed tokens
            and all(s.request.params.prompt_logprobs is None for s in items)
        )

    def _execute_graph(self, items: list[ScheduledRequest]) -> RunnerOutput:
        bs = self.block_size
        token_ids, positions, slots, tables, seq_lens = [], [], [], [], []
        for s in items:
            req = s.request
            position = req.num_computed_tokens
            table = s.block_ids
            token_ids.append(req.token_slice(position, position + 1)[0])
            positions.append(position)
            slots.append(table[position // bs] * bs + position % bs)
            tables.append(table)
            seq_lens.append(position + 1)
        assert self.graphs is not None
        logits = self.graphs.run(token_ids, positions, slots, tables, seq_lens)
        return RunnerOutput(
            sampled=items,
            logits=logits,
            prompt_logits={},
            num_context_tokens=sum(seq_lens),
        )

    def capture_cuda_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        from engine.cuda_graphs import CudaGraphRunner

        self.graphs = CudaGraphRunner(
            self.model, self.kv_caches, self.block_size, max_model_len, max_num_seqs
        )

    def _chunk(self, s: ScheduledRequest) -> BatchChunk:
        req = s.request
        start = req.num_computed_tokens
        known_end = start + s.num_tokens - len(s.spec_token_ids)
        return BatchChunk(start, req.token_slice(start, known_end) + s.spec_token_ids, s.block_ids)

    def _prompt_rows(
        self, items: list[ScheduledRequest], meta: AttentionMetadata
    ) -> list[tuple[str, int, list[int]]]:
        """(request id, first position, its rows) for chunks of requests asking for prompt
        logprobs."""
        out = []
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
            out.append((req.request_id, first, list(range(start, start + n))))
        return out

    def _pooled_hidden(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, meta: AttentionMetadata
    ) -> dict[str, tuple[int, torch.Tensor]]:
        out: dict[str, tuple[int, torch.Tensor]] = {}
        for i, s in enumerate(items):
            req = s.request
            if req.pooling is None:
                continue
            first, start = req.num_computed_tokens, meta.query_start_loc[i]
            # A pooling request has no output tokens: every row of its chunk is a prompt position.
            if req.pooling.params.needs_every_position:
                out[req.request_id] = (first, hidden[start : start + s.num_tokens])
            elif first + s.num_tokens == req.num_prompt_tokens:
                end = start + s.num_tokens
                out[req.request_id] = (req.num_prompt_tokens - 1, hidden[end - 1 : end])
        return out


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"
) -> list[LayerKVCache]:
    """The model's K and V pool per layer: [num_blocks, block_size, Hkv, D] each, zeroed, in
    the model's dtype or as fp8/int8 codes with their scales."""
    fmt = kv_cache_format(kv_cache_dtype, model.dtype)
    # This rank's KV heads: all of them, or its share under tensor parallelism.
    return [
        allocate_layer(
            fmt, num_blocks, block_size, model.num_kv_heads, model.config.head_dim, model.device
        )
        for _ in range(model.config.num_layers)
    ]


def prepare_batch(
    chunks: list[BatchChunk], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten chunks (single-token decodes first) into input ids, positions and attention
    metadata for one forward."""
    bs = block_size
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for c in chunks:
        end = c.start + len(c.token_ids)
        table = c.block_table
        token_ids += c.token_ids
        positions += range(c.start, end)
        slots += [table[p // bs] * bs + p % bs for p in range(c.start, end)]
        query_start_loc.append(query_start_loc[-1] + len(c.token_ids))
        seq_lens.append(end)
    width = max(len(c.block_table) for c in chunks)
    block_tables = torch.tensor(
        [c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int64
    )
    meta = AttentionMetadata(
        num_decodes=sum(1 for c in chunks if len(c.token_ids) == 1),
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
