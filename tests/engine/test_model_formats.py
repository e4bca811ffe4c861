"""Checkpoint formats against the HF transformers oracle (greedy, float32, token-identical):
llama3 rope scaling (new and legacy config keys), sharded safetensors with an index, bfloat16 and
float16 checkpoints, and malformed folders that must fail with a ModelLoadError naming the cause."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from tests.engine.tiny_models import build_tiny_model, hf_greedy, load_hf

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
VOCAB = 384  # tiny_models' vocab_size
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


PROMPTS = _prompts([2, 17, 70, 130])
LONG_PROMPTS = _prompts([5, 60, 120, 200])  # positions well past original_max_position_embeddings


def _engine_tokens(path: Path, prompts: list[list[int]], dtype: str = "float32") -> list[list[int]]:
    llm = LLM(model=str(path), dtype=dtype, device="cpu", block_size=16)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


def _hf_tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = load_hf(path)
    return [hf_greedy(hf, p, MAX_NEW)[0] for p in prompts]


def _read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write_config(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def plain_expected(plain) -> list[list[int]]:
    return _hf_tokens(plain, PROMPTS)


# ----- a. llama3 rope scaling --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = build_tiny_model(
        "llama", tmp_path_factory.mktemp("llama3"), rope_parameters=dict(LLAMA3_ROPE)
    )
    return path, _hf_tokens(path, LONG_PROMPTS)


def test_llama3_rope_scaling_is_in_the_saved_config(llama3):
    path, _ = llama3
    saved = _read_config(path)
    rope = saved.get("rope_parameters") or saved.get("rope_scaling")
    assert rope is not None, saved
    for key, value in LLAMA3_ROPE.items():
        assert rope[key] == value, (key, rope)
    assert saved["max_position_embeddings"] == 512
    # HF really runs with the scaling (else the oracle would not test it).
    hf = load_hf(path)
    assert hf.config.rope_parameters["rope_type"] == "llama3"


def test_llama3_rope_scaling_matches_hf(llama3):
    path, expected = llama3
    assert _engine_tokens(path, LONG_PROMPTS) == expected


def test_llama3_rope_scaling_legacy_keys_match_hf(llama3, tmp_path):
    """Pre-5.0 files keep the scaling in "rope_scaling" and theta at the top level."""
    path, expected = llama3
    legacy = tmp_path / "legacy"
    shutil.copytree(path, legacy)
    config = _read_config(legacy)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    _write_config(legacy, config)
    assert _engine_tokens(legacy, LONG_PROMPTS) == expected


def test_llama3_comparison_is_sensitive_to_the_scaling(llama3, tmp_path):
    """With the scaling stripped from config.json the engine no longer matches HF's scaled run:
    the equality above would catch an engine that ignored the scaling."""
    path, expected = llama3
    stripped = tmp_path / "stripped"
    shutil.copytree(path, stripped)
    config = _read_config(stripped)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    _write_config(stripped, config)
    unscaled = _engine_tokens(stripped, LONG_PROMPTS)
    assert unscaled != expected
    # ... while the unscaled engine still agrees with HF on the unscaled folder.
    assert unscaled == _hf_tokens(stripped, LONG_PROMPTS)


# ----- b. sharded safetensors with an index ------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, plain) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    load_hf(plain).save_pretrained(out, max_shard_size="50KB")
    return out


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*-of-*.safetensors"))


def test_sharded_checkpoint_files_exist(sharded):
    shards = _shards(sharded)
    assert len(shards) >= 3, shards
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    total = f"-of-{len(shards):05d}.safetensors"
    assert all(s.name.endswith(total) for s in shards)


def test_sharded_checkpoint_matches_hf(sharded, plain_expected):
    assert _engine_tokens(sharded, PROMPTS) == plain_expected


def test_index_naming_a_missing_shard(sharded, tmp_path):
    folder = tmp_path / "missing-shard"
    shutil.copytree(sharded, folder)
    victim = _shards(folder)[1]
    victim.unlink()
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder), dtype="float32", device="cpu")
    assert victim.name in str(info.value)


def test_index_naming_a_shard_that_was_never_written(sharded, tmp_path):
    folder = tmp_path / "bad-index"
    shutil.copytree(sharded, folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00099-of-00099.safetensors"):
        LLM(model=str(folder), dtype="float32", device="cpu")


# ----- c. checkpoint dtypes ----------------------------------------------------------------------


HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def half_dirs(tmp_path_factory, plain) -> dict[str, Path]:
    dirs = {}
    for name, dtype in HALF.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        load_hf(plain).to(dtype).save_pretrained(dirs[name])
    return dirs


@pytest.mark.parametrize("name", list(HALF))
def test_half_checkpoint_is_stored_in_half(half_dirs, name):
    path = half_dirs[name]
    tensors = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {HALF[name]}
    config = _read_config(path)
    assert config.get("dtype", config.get("torch_dtype")) == name


@pytest.mark.parametrize("name", list(HALF))
def test_half_checkpoint_upcast_to_float32_matches_hf(half_dirs, name):
    path = half_dirs[name]
    assert _engine_tokens(path, PROMPTS, dtype="float32") == _hf_tokens(path, PROMPTS)


def test_bfloat16_runs_end_to_end(half_dirs):
    path = half_dirs["bfloat16"]
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu", block_size=16)
    assert llm.engine.core.executor.model.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    results = llm.generate(PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    matches = 0
    for prompt, result in zip(PROMPTS, results):
        out = result.outputs[0]
        assert len(out.token_ids) == MAX_NEW
        assert all(0 <= t < VOCAB for t in out.token_ids)
        assert all(torch.isfinite(torch.tensor(list(lp.values()))).all() for lp in out.logprobs)
        tokens, logprobs = hf_greedy(hf, prompt, 1)
        first = out.token_ids[0]
        matches += first == tokens[0]
        # bf16 numerics differ between the two; our first pick is at least near HF's best.
        assert logprobs[0][first] >= logprobs[0].max() - 0.5
    assert matches >= 3, matches


# ----- d. malformed folders ----------------------------------------------------------------------


def _copy(plain: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(plain, folder)
    return folder


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"],
)
def test_config_missing_required_field(plain, tmp_path, field):
    folder = _copy(plain, tmp_path, f"no-{field}")
    config = _read_config(folder)
    del config[field]
    _write_config(folder, config)
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder), dtype="float32", device="cpu")
    assert field in str(info.value)


def test_config_invalid_json(plain, tmp_path):
    folder = _copy(plain, tmp_path, "bad-json")
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(folder), dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "key, rope",
    [
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
        ("rope_scaling", {"type": "yarn", "factor": 4.0}),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
        ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ],
    ids=["yarn", "yarn-legacy", "dynamic", "linear"],
)
def test_unsupported_rope_scaling(plain, tmp_path, key, rope):
    folder = _copy(plain, tmp_path, "rope")
    config = _read_config(folder)
    config.pop("rope_parameters", None)
    config[key] = rope
    _write_config(folder, config)
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder), dtype="float32", device="cpu")
    kind = rope.get("rope_type", rope.get("type"))
    assert repr(kind) in str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_tensor_with_wrong_shape(plain, tmp_path, name):
    folder = _copy(plain, tmp_path, "bad-shape")
    weights = load_file(str(folder / "model.safetensors"))
    bad = weights[name]
    weights[name] = torch.zeros((bad.shape[0] + 16, *bad.shape[1:]), dtype=bad.dtype)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder), dtype="float32", device="cpu")
    assert name in str(info.value)


def test_missing_tensor(plain, tmp_path):
    folder = _copy(plain, tmp_path, "missing-tensor")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.v_proj.weight"):
        LLM(model=str(folder), dtype="float32", device="cpu")
