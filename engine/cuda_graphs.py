"""CUDA graphs for decode-only steps.

A decode step of a small model on a big GPU is launch-bound: thirty layers of a dozen kernels
each take longer to launch from Python than to run. A CUDA graph records the whole forward once
per batch size and replays it with one launch. Graphs need fixed shapes and addresses, so each
step copies its inputs into static buffers sized for the largest batch, padded to the next
captured size: padding rows write no KV (slot -1) and attend one token; their logits are dropped.
Captured sizes follow vLLM: 1, 2, 4, 8, then every 8 up to max_num_seqs. Mixed steps (any
prefill) run eagerly.

The attention backend must be capturable: no host synchronisation, and launch grids that do not
depend on the step's context lengths. The graph's metadata therefore claims max_model_len for
every row (`seq_lens_list`), which sizes the grid for the longest context; the kernels read the
true lengths from `seq_lens` on the device."""

from __future__ import annotations

import logging

import torch

from engine.attention.kv_quant import LayerKVCache
from engine.attention.metadata import AttentionMetadata
from engine.models.llama import LlamaModel

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, *range(8, max_num_seqs + 1, 8)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[LayerKVCache],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        largest, width = self.sizes[-1], -(-max_model_len // block_size)
        device = model.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, width, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated(device)
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            self._capture(size)
        log.info(
            "captured CUDA graphs for decode batches %s (%.0f MiB)",
            self.sizes,
            (torch.cuda.memory_allocated(device) - before) / (1 << 20),
        )

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=size,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens_list=[self.max_model_len] * size,
            block_size=self.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model.forward(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size)
        )
        return self.model.compute_logits(hidden)

    def _capture(self, size: int) -> None:
        # Warm up on a side stream first (lazy initialisation, Triton compilation), as
        # torch.cuda.graphs requires; then record.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[size] = self._forward(size)
        self.graphs[size] = graph

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Logits [n, vocab] for n decode rows (n <= max_batch)."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        device = self.input_ids.device
        self.input_ids[:n].copy_(torch.tensor(token_ids, device=device))
        self.positions[:n].copy_(torch.tensor(positions, device=device))
        self.slot_mapping[:n].copy_(torch.tensor(slots, device=device))
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, device=device))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        self.block_tables[:n, :width].copy_(torch.tensor(padded, device=device))
        # Padding rows: no KV write, one attended token, token 0 at position 0.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.graphs[size].replay()
        return self.logits[size][:n]
