"""The default model (SmolLM2-135M-Instruct converted from the wheel's GGUF) answers a chat prompt
exactly as HF transformers does on the same converted folder."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.model_fetch import fetch_default_model

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the night shift.",
]


@pytest.fixture(scope="module")
def model_dir():
    return fetch_default_model()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model="default", max_num_seqs=8)


def test_chat_greedy_matches_hf(llm, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    results = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=48))
    for conv, result in zip(conversations, results):
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        assert result.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=48, do_sample=False)
        expected = out[0, ids.shape[1] :].tolist()
        assert result.outputs[0].token_ids == expected
        ours = result.outputs[0]
        # EOS ends both; its text is not part of the answer.
        assert ours.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in results[0].outputs[0].text
    assert results[0].outputs[0].finish_reason == "stop"


def test_stop_string_cuts_text(llm):
    result = llm.generate(
        ["The first three planets of the solar system are"],
        SamplingParams(temperature=0.0, max_tokens=40, stop=[","]),
    )[0].outputs[0]
    assert result.finish_reason == "stop" and result.stop_reason == ","
    assert "," not in result.text and result.text
