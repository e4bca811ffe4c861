"""Nightshift's inference engine: paged KV cache, prefix caching, continuous batching.

The public names load on first use (PEP 562), so that tools which only need a light submodule
(the digest's `engine.model_fetch`, `engine.server.server_process`) do not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
