"""The whole-step decode kernel (engine/kernels/cpu_decode.c) against the layer-by-layer Python
path on the same int4 weights: same hidden states and the same keys and values written, for
batches of decodes over shuffled block tables; and the steps it must leave to the Python path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.kv_quant import LayerKVCache
from engine.attention.metadata import AttentionMetadata
from engine.kernels import cpu_decode, cpu_quant
from engine.models.loader import load_model
from tests.engine.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(
    cpu_quant.isa() != "avx512-vnni", reason="the decode kernel runs on AVX512-VNNI CPUs only"
)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")
    # the loader puts the layer-by-layer path on the decode step's kernels too
    m = load_model(path, torch.float32, torch.device("cpu"), 512, quantization="int4")
    assert m.decode_step is not None, "an int4 CPU model should take the decode kernel"
    return m


def _decode_batch(model, seq_lens: list[int], block_size: int = 16, pool_blocks: int = 80):
    """Random pools holding each request's earlier keys and values (shuffled blocks), and one
    decode step: request r adds its token at position seq_lens[r] - 1."""
    g = torch.Generator().manual_seed(sum(seq_lens))
    shape = (pool_blocks, block_size, model.num_kv_heads, model.config.head_dim)
    caches = [
        LayerKVCache(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in model.layers
    ]
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(pool_blocks, generator=g)[: sum(need)]
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int64)
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = ids[at : at + n]
        at += n
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.stack(
        [tables[r, p // block_size] * block_size + p % block_size for r, p in enumerate(positions)]
    )
    meta = AttentionMetadata(
        num_decodes=len(seq_lens),
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens_list=list(seq_lens),
        block_size=block_size,
    )
    tokens = torch.randint(0, model.config.vocab_size, (len(seq_lens),), generator=g)
    return tokens, positions, caches, meta


def _both_paths(model, tokens, positions, caches, meta):
    copies = [LayerKVCache(c.k.clone(), c.v.clone()) for c in caches]
    fused = model.forward(tokens, positions, caches, meta)
    step, model.decode_step = model.decode_step, None
    try:
        python = model.forward(tokens, positions, copies, meta)
    finally:
        model.decode_step = step
    return fused, python, caches, copies


@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 70, 16, 200], [17] * 9])
def test_a_decode_step_matches_the_python_path(model, seq_lens):
    fused, python, caches, copies = _both_paths(model, *_decode_batch(model, seq_lens))
    # The same kernels in the same order: the same floats, so a request's tokens do not depend
    # on whether its step also held prompt chunks (which go layer by layer).
    assert torch.equal(fused, python)
    for mine, theirs in zip(caches, copies):
        assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)


def test_steps_it_does_not_take_go_layer_by_layer(model):
    tokens, positions, caches, meta = _decode_batch(model, [9, 30])
    step = model.decode_step
    hidden = torch.randn(2, model.config.hidden_size)
    # a prompt chunk in the step
    prefill = AttentionMetadata(
        num_decodes=1, slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
        seq_lens=meta.seq_lens, query_start_loc=[0, 1, 2], seq_lens_list=meta.seq_lens_list,
        block_size=meta.block_size,
    )  # fmt: skip
    assert step.run(hidden, positions, caches, prefill) is None
    # a quantized K/V pool
    scaled = [LayerKVCache(c.k.to(torch.int8), c.v.to(torch.int8), c.k[..., 0], c.v[..., 0])
              for c in caches]  # fmt: skip
    assert step.run(hidden, positions, scaled, meta) is None
    assert step.run(hidden, positions, caches, meta) is not None


def test_switched_off_by_the_environment(model, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_CPU_DECODE", "0")
    assert cpu_decode.DecodeStep.of(model) is None


def test_float_and_int8_models_stay_layer_by_layer(tmp_path: Path):
    path = build_tiny_model("llama", tmp_path / "m")
    for quantization in (None, "int8"):
        m = load_model(path, torch.float32, torch.device("cpu"), 64, quantization=quantization)
        assert m.decode_step is None


def test_a_decode_token_is_the_same_in_a_step_with_a_prompt_chunk(model):
    # A step that also holds a prompt chunk goes layer by layer; a decode token in it must come
    # out as in a step of decodes alone, or a request's tokens depend on what else the server is
    # doing. Found from outside: six concurrent greedy requests to an int4 server differed from
    # the same six sent one at a time, until the loader put the layer-by-layer path on the
    # decode step's kernels.
    tokens, positions, caches, meta = _decode_batch(model, [40, 9])
    block = meta.block_size
    chunk = 5  # request 1 as a prompt chunk: its last 5 tokens, positions 4..8
    chunk_pos = torch.arange(9 - chunk, 9)
    chunk_slots = meta.block_tables[1, chunk_pos // block] * block + chunk_pos % block
    mixed = AttentionMetadata(
        num_decodes=1,
        slot_mapping=torch.cat([meta.slot_mapping[:1], chunk_slots]),
        block_tables=meta.block_tables,
        seq_lens=meta.seq_lens,
        query_start_loc=[0, 1, 1 + chunk],
        seq_lens_list=meta.seq_lens_list,
        block_size=block,
    )
    alone = AttentionMetadata(
        num_decodes=1, slot_mapping=meta.slot_mapping[:1], block_tables=meta.block_tables[:1],
        seq_lens=meta.seq_lens[:1], query_start_loc=[0, 1], seq_lens_list=meta.seq_lens_list[:1],
        block_size=block,
    )  # fmt: skip
    copies = [LayerKVCache(c.k.clone(), c.v.clone()) for c in caches]
    ids = torch.cat([tokens[:1], torch.arange(20, 20 + chunk)])
    with_chunk = model.forward(ids, torch.cat([positions[:1], chunk_pos]), caches, mixed)
    by_itself = model.forward(tokens[:1], positions[:1], copies, alone)
    assert torch.equal(with_chunk[0], by_itself[0])
