"""A tiny random-weight Llama that speaks the default model's tokenizer, for measuring what
quantization does to a model whose weights were never trained (`nightshift bench accuracy
--model random`): the default model's tokenizer, vocabulary and rotary settings, and small
random layers (seeded, so two runs score the same model).

Built with HF transformers' own LlamaForCausalLM, the architecture the engine loads; nothing is
downloaded (the tokenizer comes from the converted default model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_random_model(
    dst: Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    init_range: float = 0.15,
) -> Path:
    """A random Llama in `dst` (created): the default model's config with these sizes.
    init_range: the weights' standard deviation; HF's 0.02 gives near-uniform next-token
    distributions, too flat for quantization to show."""
    import transformers

    from engine.model_fetch import resolve_model

    source = resolve_model("default")
    config = json.loads((source / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        initializer_range=init_range,
        torch_dtype="float32",
    )
    config.pop("head_dim", None)  # hidden / heads
    dst.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(**config)
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float32).eval()
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, dst / name)
    return dst
