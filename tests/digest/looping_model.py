"""A tiny model that says one sentence over and over, whatever it is asked: the loop a small
model falls into (issue 19), made certain, so that a test can watch the digest ask again.

Its layers add nothing to the residual stream (their output projections are zero), so each
step's logits depend on the current token alone, through the embedding and the LM head. The
sentence's tokens get orthogonal embeddings, and the head maps each to the next with a margin
(800) that no frequency penalty of the digest's (1.0 a repeat) erodes within a reply."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from tests.engine.server.live_server import build_chat_model

SENTENCE = " We propose a simple method that improves results."
MARGIN = 100.0


def build_looping_model(path: Path) -> Path:
    folder = build_chat_model(path, max_position_embeddings=2048)
    cycle = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(SENTENCE).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hidden = model.config.hidden_size
    assert len(set(cycle)) == len(cycle) <= hidden, cycle  # one successor per token
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, token in enumerate(cycle):
            following = cycle[(i + 1) % len(cycle)]
            embed[token].zero_()
            embed[token, i] = 1.0
            head[following].zero_()
            head[following, i] = MARGIN
    model.save_pretrained(folder)
    return folder
