"""Draft-model proposals: a smaller model with the target's tokenizer guesses the next k tokens
greedily, one batched forward per guessed position.

The draft keeps its own K/V tensors but shares the target's block tables: a request's draft K/V
for position p sits in the same block and slot as its target K/V, so allocation, prefix sharing
and freeing need no second block manager. The draft tracks, per request, how many positions of its
K/V are valid; after verification that is at most the target's computed count (positions past it
held rejected drafts), and a preempted request starts over. Blocks a request takes over from the
prefix cache may hold another request's draft K/V, or none; the draft recomputes a request's
tokens from its own valid count, so it never reads them (a cached block's contents are identical
anyway when they were written).

The proposals are the draft's argmax, a deterministic choice: verification treats each as a point
mass, which keeps sampled requests exactly on the target distribution (see rejection_sampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.kv.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaModel
from engine.request import Request
from engine.runner import BatchChunk, allocate_kv_caches, prepare_batch


@dataclass(slots=True)
class _DraftState:
    num_preemptions: int  # the request's count when `computed` was recorded
    computed: int  # positions whose draft K/V is valid, if nothing was rejected since


class DraftProposer:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCacheManager,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
    ):
        """kv_cache_dtype: the target's (the KV budget counts the draft's blocks in it too)."""
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, kv_cache_dtype)
        self._state: dict[str, _DraftState] = {}

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        """Set spec_token_ids of each (request, k) to k tokens. The draft writes K/V at the
        positions of the request's last token and all guesses but the final one, in the
        lookahead slots the scheduler allocated with the step (num_lookahead_tokens); a request
        without them (never, while the scheduler allocates them) gets fewer guesses."""
        jobs: list[tuple[Request, int, int]] = []  # request, k, first position to feed
        for request, k in requests:
            room = len(self.kv.block_ids(request.request_id)) * self.block_size
            k = min(k, room - request.num_tokens + 1)
            if k < 1:
                request.spec_token_ids = []
                continue
            jobs.append((request, k, self._valid(request)))
        if not jobs:
            return
        # Round 0 catches the draft up to the request's last token and guesses the first draft;
        # round j feeds guess j and guesses j + 1.
        chunks = [
            BatchChunk(start, request.token_slice(start, request.num_tokens), self._table(request))
            for request, _, start in jobs
        ]
        guesses = self._forward(chunks)
        drafts = [[g] for g in guesses]
        for j in range(1, max(k for _, k, _ in jobs)):
            active = [i for i, (_, k, _) in enumerate(jobs) if k > j]
            chunks = [
                BatchChunk(jobs[i][0].num_tokens - 1 + j, [drafts[i][-1]], self._table(jobs[i][0]))
                for i in active
            ]
            for i, g in zip(active, self._forward(chunks)):
                drafts[i].append(g)
        for (request, k, _), tokens in zip(jobs, drafts):
            request.spec_token_ids = tokens
            # Positions num_tokens - 1 .. num_tokens + k - 2 were fed: the last token and all
            # guesses but the final one.
            self._state[request.request_id] = _DraftState(
                request.num_preemptions, request.num_tokens + k - 1
            )

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def _valid(self, request: Request) -> int:
        state = self._state.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0
        return min(state.computed, request.num_computed_tokens)

    def _table(self, request: Request) -> list[int]:
        return self.kv.block_ids(request.request_id)

    def _forward(self, chunks: list[BatchChunk]) -> list[int]:
        """The draft's argmax after each chunk's last token, in the chunks' order."""
        # Single-token chunks first, by context length: the order the attention backends want.
        order = sorted(
            range(len(chunks)),
            key=lambda i: (
                len(chunks[i].token_ids) != 1,
                len(chunks[i].token_ids),
                chunks[i].start,
            ),
        )
        input_ids, positions, meta = prepare_batch(
            [chunks[i] for i in order], self.block_size, self.model.device
        )
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        last_rows = [end - 1 for end in meta.query_start_loc[1:]]
        tokens = self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
        out = [0] * len(chunks)
        for row, i in enumerate(order):
            out[i] = tokens[row]
        return out


def load_draft_model(path: Path, core, placement) -> LlamaModel:
    """The draft model at `path` (a model folder or "default"), on the target's device and dtype
    (`placement`), after checking that its token ids mean what the target's mean. Under tensor
    parallelism it runs whole on rank 0, beside that rank's shard of the target."""
    from engine.errors import ModelLoadError
    from engine.model_fetch import resolve_model
    from engine.models.loader import load_model
    from engine.models.model_config import load_model_config
    from engine.tokenizer import load_tokenizer

    draft_dir = resolve_model(str(path))
    config = load_model_config(draft_dir)
    if config.vocab_size != core.vocab_size:
        raise ModelLoadError(
            f"draft model {draft_dir} has a vocabulary of {config.vocab_size} tokens, the target "
            f"{core.vocab_size}: a draft must share the target's tokenizer"
        )
    if config.max_position_embeddings < core.max_model_len:
        raise ModelLoadError(
            f"draft model {draft_dir} supports {config.max_position_embeddings} positions, fewer "
            f"than max_model_len {core.max_model_len}; lower max_model_len"
        )
    draft_tokenizer = load_tokenizer(draft_dir)
    if (
        core.tokenizer is not None
        and draft_tokenizer is not None
        and draft_tokenizer.get_vocab() != core.tokenizer.get_vocab()
    ):
        raise ModelLoadError(
            f"draft model {draft_dir} has a different tokenizer from the target's: a draft must "
            f"share the target's tokenizer"
        )
    return load_model(
        draft_dir, placement.dtype, placement.device, core.max_model_len, placement.kernels
    )
