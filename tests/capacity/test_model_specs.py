import json
import struct
from pathlib import Path

import pytest

from capacity.model_specs import (
    CATALOGUE,
    ModelSpec,
    ModelSpecError,
    check_tp,
    find_model,
    kv_heads_per_gpu,
    load_model_spec,
    param_count,
    param_counts,
)
from engine.model_fetch import default_model_dir, is_converted

# The exact counts the catalogue's shapes give, and the totals the model cards / hubs publish.
EXPECTED_PARAMS = {
    "Llama-3.1-8B": (8_030_261_248, 8.03e9),
    "Llama-3.1-70B": (70_553_706_496, 70.6e9),
    "Qwen2.5-0.5B": (494_032_768, 0.49e9),
    "Qwen2.5-1.5B": (1_543_714_304, 1.54e9),
    "Qwen2.5-3B": (3_085_938_688, 3.09e9),
    "Qwen2.5-7B": (7_615_616_512, 7.61e9),
    "Qwen2.5-14B": (14_770_033_664, 14.7e9),
    "Qwen2.5-32B": (32_763_876_352, 32.5e9),
    "Qwen2.5-72B": (72_706_203_648, 72.7e9),
    "Qwen3-8B": (8_190_735_360, 8.2e9),
    "Mistral-7B-v0.3": (7_248_023_552, 7.25e9),
    "SmolLM2-135M-Instruct": (134_515_008, 134.5e6),
    "Llama-3-8B": (8_030_261_248, 8.03e9),
    "Llama-3-70B": (70_553_706_496, 70.6e9),
    "Llama-3.3-70B": (70_553_706_496, 70.6e9),
    "Llama-2-7B": (6_738_415_616, 6.74e9),  # the model card's "7B"; the checkpoint holds 6.74B
    "Qwen3-14B": (14_768_307_200, 14.8e9),
    "Qwen3-32B": (32_762_123_264, 32.8e9),
}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen2.5-7B-Instruct-AWQ", "Qwen2.5-7B"),
        ("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7B"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B-v0.3"),
        ("Qwen/Qwen3-14B-FP8", "Qwen3-14B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
    ],
)
def test_checkpoint_names_resolve_to_their_shapes(name, expected):
    assert find_model(name).name == expected


@pytest.mark.parametrize("name", EXPECTED_PARAMS)
def test_catalogue_param_counts(name):
    exact, published = EXPECTED_PARAMS[name]
    assert param_count(find_model(name)) == exact
    assert exact == pytest.approx(published, rel=0.01)


def test_catalogue_is_complete_and_sourced():
    assert {s.name for s in CATALOGUE} == set(EXPECTED_PARAMS)
    for spec in CATALOGUE:
        assert spec.source.startswith("https://huggingface.co/")
        assert spec.num_heads * spec.head_dim >= spec.num_kv_heads * spec.head_dim


def test_default_model_facts():
    spec = find_model("default")
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.head_dim, spec.intermediate_size, spec.vocab_size) == (64, 1536, 49152)
    assert spec.tie_word_embeddings


def test_llama_8b_breakdown():
    counts = param_counts(find_model("Llama-3.1-8B"))
    assert counts.embedding == counts.lm_head == 128256 * 4096
    # per layer: q 4096^2 + k,v 2 x 4096 x 1024 + o 4096^2 + MLP 3 x 4096 x 14336
    assert counts.linear == 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert counts.layer_other == 32 * 2 * 4096 and counts.final_norm == 4096


def _safetensors_numel(path: Path) -> int:
    # The header alone: 8-byte little-endian length, then JSON of name -> dtype/shape/offsets.
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            n = 1
            for dim in info["shape"]:
                n *= dim
            total += n
    return total


def test_default_model_count_equals_its_checkpoint():
    folder = default_model_dir()
    if not is_converted(folder):
        pytest.skip("default model not fetched")
    spec = load_model_spec(folder)
    assert _shape(spec) == _shape(find_model("default"))
    assert param_count(spec) == _safetensors_numel(folder / "model.safetensors") == 134_515_008


def _shape(spec: ModelSpec) -> dict:
    return {f: getattr(spec, f) for f in ModelSpec.__slots__ if f not in ("name", "source")}


@pytest.mark.parametrize(
    ("family", "tied"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)]
)
def test_param_count_equals_transformers(tmp_path, family, tied):
    pytest.importorskip("transformers")
    from tests.engine.tiny_models import build_tiny_model

    path = build_tiny_model(family, tmp_path / family, tied=tied)
    spec = load_model_spec(path)
    assert spec.qkv_bias == (family == "qwen2") and spec.qk_norm == (family == "qwen3")
    assert param_count(spec) == _safetensors_numel(path / "model.safetensors")


def test_names_resolve_case_insensitively():
    for name in ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B"):
        assert find_model(name).name == "Llama-3.1-8B"
    assert load_model_spec("Qwen/Qwen2.5-7B-Instruct").qkv_bias
    assert load_model_spec("HuggingFaceTB/SmolLM2-135M-Instruct").name == "SmolLM2-135M-Instruct"
    with pytest.raises(ModelSpecError, match="unknown model 'Llama-9B'.*Llama-3.1-8B"):
        load_model_spec("Llama-9B")


def _write(tmp_path: Path, raw: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_config_json_defaults_and_nesting(tmp_path):
    raw = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    spec = load_model_spec(_write(tmp_path, raw))
    assert (spec.num_kv_heads, spec.head_dim, spec.qkv_bias) == (4, 16, True)
    assert not spec.tie_word_embeddings and spec.source.endswith("config.json")
    nested = load_model_spec(_write(tmp_path, {"text_config": {**raw, "attention_bias": False}}))
    assert not nested.qkv_bias
    del raw["vocab_size"]
    _write(tmp_path, raw)
    with pytest.raises(ModelSpecError, match="'vocab_size'"):
        load_model_spec(tmp_path / "config.json")


def test_tp_splits():
    spec = find_model("Qwen2.5-7B")  # 28 heads, 4 KV heads
    check_tp(spec, 4)
    assert kv_heads_per_gpu(spec, 4) == 1
    with pytest.raises(ModelSpecError, match="28 attention heads"):
        check_tp(spec, 8)
    llama = find_model("Llama-3.1-70B")  # 8 KV heads: replicated at tp=16
    check_tp(llama, 16)
    assert kv_heads_per_gpu(llama, 16) == 1
    assert param_counts(llama, 4).linear * 4 == param_counts(llama).linear
