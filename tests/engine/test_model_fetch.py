"""Default-model fetch: cache location, integrity check, idempotence and the real conversion."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from engine import gguf_convert
from engine import model_fetch as mf
from engine.errors import ModelLoadError


@pytest.fixture
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    return home


def test_nightshift_home_honors_env(tmp_home: Path) -> None:
    assert mf.nightshift_home() == tmp_home
    assert mf.default_model_dir() == tmp_home / "models" / mf.DEFAULT_MODEL_NAME


def test_nightshift_home_falls_back_to_xdg_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NIGHTSHIFT_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert mf.nightshift_home() == tmp_path / "nightshift"


def test_sha256_rejects_corrupted_file(tmp_path: Path) -> None:
    bad = tmp_path / mf.GGUF_FILENAME
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match=r"sha256.*expected") as info:
        mf.verify_sha256(bad, mf.GGUF_SHA256)
    assert str(bad) in str(info.value)


def test_sha256_accepts_matching_file(tmp_path: Path) -> None:
    good = tmp_path / "f.bin"
    good.write_bytes(b"nightshift")
    mf.verify_sha256(good, hashlib.sha256(b"nightshift").hexdigest())


def test_resolve_model_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        mf.resolve_model(str(missing))


def test_resolve_model_existing_path(tmp_path: Path) -> None:
    assert mf.resolve_model(str(tmp_path)) == tmp_path


def test_packaged_gguf_found_without_importing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / mf.WHEEL_PACKAGE
    pkg.mkdir()
    # The real __init__ imports `llm`, which is not installed; it must never run.
    (pkg / "__init__.py").write_text("raise ImportError('package __init__ must not run')\n")
    (pkg / mf.GGUF_FILENAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert mf._packaged_gguf() == pkg / mf.GGUF_FILENAME


def test_fetch_is_a_noop_when_already_converted(
    tmp_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = mf.default_model_dir()
    folder.mkdir(parents=True)
    for name in mf.REQUIRED_FILES:
        (folder / name).write_text("{}")
    mf._write_marker(folder)
    monkeypatch.setattr(mf, "locate_gguf", _must_not_be_called)
    assert mf.fetch_default_model() == folder
    assert mf.resolve_model("default") == folder


def test_stale_marker_means_not_converted(tmp_home: Path) -> None:
    folder = mf.default_model_dir()
    folder.mkdir(parents=True)
    for name in mf.REQUIRED_FILES:
        (folder / name).write_text("{}")
    (folder / mf.MARKER_FILENAME).write_text(json.dumps({"converter_version": -1}))
    assert not mf.is_converted(folder)


def test_corrupt_gguf_leaves_no_folder(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_home / "bad.gguf"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a gguf")
    monkeypatch.setattr(mf, "locate_gguf", lambda: bad)
    with pytest.raises(mf.ModelFetchError, match="sha256"):
        mf.fetch_default_model()
    assert not mf.default_model_dir().exists()
    assert os.listdir(tmp_home) == ["bad.gguf"]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # As in llama.cpp's convert_hf_to_gguf.py LlamaModel.permute.
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    for n_head in (1, 3):
        assert np.array_equal(gguf_convert._unpermute_rope(llama_cpp_permute(w, n_head), n_head), w)


def test_real_default_model_converts_to_hf_llama() -> None:
    folder = mf.fetch_default_model()  # cached after the first run (`nightshift model fetch`)
    assert mf.is_converted(folder)
    for name in mf.REQUIRED_FILES:
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]

    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied: the head reuses the embedding
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576]
        assert str(embed.get_dtype()) == "F32"


def test_real_default_model_answers_in_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    # End-to-end guard on the conversion (Q/K un-permutation, tokenizer, chat template).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = mf.fetch_default_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def _must_not_be_called() -> Path:
    raise AssertionError("locate_gguf called although the model is already converted")
