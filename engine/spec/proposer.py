"""What the engine needs of a proposer, and how it builds the configured one."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from engine.config import EngineConfig
from engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[tuple[Request, int]]) -> None:
        """Set spec_token_ids of each (request, k) to at most k proposed tokens."""

    def forget(self, request_id: str) -> None:
        """The request has ended: drop whatever the proposer kept for it."""


def build_proposer(config: EngineConfig, core, placement) -> Proposer | None:
    """The proposer config.speculative names, for `core` (an EngineCore: its model config, KV
    manager and tokenizer) whose model runs as `placement` says (an engine_builder.Placement);
    None without speculative decoding."""
    if config.speculative is None:
        return None
    if config.speculative == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from engine.spec.draft import DraftProposer, load_draft_model

    model = load_draft_model(Path(config.draft_model), core, placement)
    return DraftProposer(model, core.kv, core.num_blocks, config.block_size, config.kv_cache_dtype)
