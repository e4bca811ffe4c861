"""Ranks started apart must agree on the model and the options that shape the KV cache and the
forward: their identities are compared when they join."""

import shutil

import torch

from engine.config import EngineConfig
from engine.distributed.identity import (
    SAMPLE_BYTES,
    SAMPLES,
    fingerprint,
    mismatch,
    rank_identity,
)
from engine.engine_builder import place
from engine.models.model_config import load_model_config
from tests.engine.tiny_models import build_tiny_model


def _identity(path, **options):
    config = EngineConfig(model=str(path), device="cpu", tensor_parallel_size=2, **options)
    return rank_identity(config, place(config, path, load_model_config(path)))


def test_a_copy_of_the_checkpoint_is_the_same_model(tmp_path):
    path = build_tiny_model("llama", tmp_path / "a")
    shutil.copytree(path, tmp_path / "copy")
    assert fingerprint(path) == fingerprint(tmp_path / "copy")
    assert mismatch(1, _identity(path), 0, _identity(tmp_path / "copy")) is None


def test_same_shapes_with_other_weights_is_another_model(tmp_path):
    a = build_tiny_model("llama", tmp_path / "a", seed=0)
    b = build_tiny_model("llama", tmp_path / "b", seed=1)
    problem = mismatch(1, _identity(b), 0, _identity(a))
    assert problem is not None
    assert "rank 1 was started differently from rank 0" in problem
    assert f"{b} here, {a} on rank 0: different checkpoint files" in problem
    assert problem.endswith("every rank needs the same model and the same --model")


def test_options_that_shape_the_cache_are_named_with_their_flags(tmp_path):
    path = build_tiny_model("llama", tmp_path / "a")
    problem = mismatch(0, _identity(path), 1, _identity(path, max_model_len=64, block_size=8))
    assert "max_model_len (512 here, 64 on rank 1)" in problem
    assert "block_size (16 here, 8 on rank 1)" in problem
    assert "--max-model-len, --block-size" in problem
    problem = mismatch(0, _identity(path), 1, _identity(path, dtype="bfloat16"))
    assert "dtype (float32 here, bfloat16 on rank 1)" in problem


def test_a_big_weight_file_is_sampled_throughout(tmp_path):
    """A file too big to hash whole is sampled at SAMPLES places from its start to its end:
    fine-tunes of one base keep the header and the sizes, but their tensors differ throughout,
    so at every sample."""
    (tmp_path / "config.json").write_text("{}")
    data = torch.randint(0, 256, (8 * 1024 * 1024,), dtype=torch.uint8).numpy().tobytes()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(data)
    before = fingerprint(tmp_path)
    middle = (len(data) - SAMPLE_BYTES) * (SAMPLES // 2) // (SAMPLES - 1)
    for offset in (0, middle + 100, len(data) - 1):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        weights.write_bytes(changed)
        assert fingerprint(tmp_path) != before, offset
    weights.write_bytes(data + b"\0")
    assert fingerprint(tmp_path) != before
