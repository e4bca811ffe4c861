"""GGUF -> Hugging Face folder conversion for llama-architecture models: each tensor dequantized
to float32 with the `gguf` package, Q/K projections un-permuted (llama.cpp reorders them for its
RoPE), the config and tokenizer written from the GGUF's own metadata."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from engine.model_fetch import ModelFetchError, write_json

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
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", _generation_config(config))
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
    write_json(path, cfg)
