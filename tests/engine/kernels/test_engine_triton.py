"""The whole engine on the Triton path (attention backend and fused ops; interpreted on a CPU)
gives the torch path's greedy tokens: mixed steps, chunked prefill, a prefix-cache hit."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny_models import build_tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_engine_matches_torch_engine(tmp_path, family):
    model = build_tiny_model(family, tmp_path / family)
    prompts = [[5, 9, 13, 2, 77, 31, 8, 90, 4, 6, 11], [5, 9, 13, 2, 77, 31, 8, 90, 40], [3, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = {}
    for kernels in ("torch", "triton"):
        # A 16-token budget splits the 11-token prompt across steps next to decodes.
        llm = LLM(
            model=str(model),
            dtype="float32",
            device="cpu",
            attention_backend=kernels,
            block_size=16,
            max_num_batched_tokens=16,
            num_kv_blocks=32,
        )
        backend = type(llm.engine.core.executor.model.backend).__name__
        assert (
            backend
            == {"triton": "TritonAttentionBackend", "torch": "TorchAttentionBackend"}[kernels]
        )
        results[kernels] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert results["triton"] == results["torch"]
