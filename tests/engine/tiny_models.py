"""Tiny random-weight checkpoints of each supported family, and the HF transformers oracle."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": None},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
}


def build_tiny_model(
    family: str, out_dir: Path, tied: bool = False, seed: int = 0, **overrides
) -> Path:
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        initializer_range=0.15,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=None,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32).eval()
    if family == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


def load_hf(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(
    model, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """HF generate, one prompt at a time (no padding): tokens and each step's log-softmax."""
    # No EOS for the oracle: the engine runs with ignore_eos, and HF's min_new_tokens would mask
    # the EOS logit instead of ignoring it, changing the argmax.
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs
