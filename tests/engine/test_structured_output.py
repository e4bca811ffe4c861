"""Structured output: constraints are validated when SamplingParams is built, compiled once per
spec, applied only to the constrained rows of a batch, and followed through batching, preemption
and n > 1; the default model writes digest reviews that all validate."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from digest.prompts import review_messages
from digest.review import Review
from digest.review_parse import review_response_format
from engine import LLM, SamplingParams
from engine.errors import InvalidStructuredOutputError
from engine.model_fetch import fetch_default_model
from engine.structured.bitmask import GrammarMask, apply_grammar_mask, fill_grammar_mask
from engine.structured.grammar import GrammarCompiler, parse_spec
from engine.tokenizer import load_tokenizer
from tests.engine.tiny_models import build_tiny_model

# Bounded in length, so even a random model completes it.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "label", "ok"],
    "additionalProperties": False,
}
SHORT_PAPERS = [
    (
        "Sparse Attention for Long Documents",
        "A sparse attention pattern lets transformers read "
        "64k-token documents; it matches dense attention on summarization with a quarter of the "
        "memory.",
    ),
    (
        "Faster Tokenizers with Finite Automata",
        "BPE merges compiled into a finite automaton make "
        "tokenization four times faster on CPU with identical output.",
    ),
    (
        "Curriculum Learning for Code Models",
        "Ordering training files by difficulty lets a 1B code "
        "model solve 6% more benchmark problems.",
    ),
    (
        "Evaluating Chatbots with Pairwise Judges",
        "Model judges prefer longer answers; a length-controlled score removes most of this bias.",
    ),
    (
        "Quantized Inference on Phones",
        "A 3B model runs on a phone with 4-bit weights at 40 ms per "
        "token, losing under one point of accuracy.",
    ),
    (
        "Retrieval Helps Small Models",
        "A Wikipedia retriever lets a 350M model match a model ten "
        "times larger on open-domain question answering.",
    ),
    (
        "Detecting Machine-Generated Text",
        "A classifier on reference-model token probabilities "
        "detects generated essays with 92% accuracy but fails on paraphrases.",
    ),
    (
        "Speech Recognition for Low-Resource Languages",
        "Fine-tuning on 20 hours of audio per "
        "language cuts word error rates by a third in twelve African languages.",
    ),
    (
        "Reward Models Overfit to Style",
        "Reward models favour formatting such as bullet lists; "
        "removing it flips the preferred answer in 30% of pairs.",
    ),
    (
        "A Benchmark for Table Reasoning",
        "5,000 questions over public spreadsheets: the best model "
        "answers 61% correctly, humans 94%.",
    ),
    (
        "Graph Networks for Molecules",
        "Message passing combined with a chemical language model "
        "improves solubility prediction on two datasets.",
    ),
    (
        "Energy Use of Training Language Models",
        "Energy per token for training eight open models "
        "varies fourfold across data centers with the same hardware.",
    ),
    (
        "Prompt Compression for Long Contexts",
        "Learning to drop unneeded prompt tokens halves "
        "prompts at a two-point loss in answer accuracy.",
    ),
    (
        "Self-Correction Without Feedback",
        "Asking models to revise their own math solutions helps "
        "large models slightly and hurts small ones.",
    ),
    (
        "Privacy Risks of Fine-Tuning Data",
        "Targeted prompts extract training examples from "
        "fine-tuned models; more epochs leak more verbatim text.",
    ),
    (
        "Vision-Language Models Count Poorly",
        "Ten vision-language models count objects below 50% "
        "accuracy once an image holds more than six.",
    ),
    (
        "Sharing KV Caches Across Requests",
        "Sharing attention key-value caches between requests "
        "with a common prefix raises chat serving throughput 2.1 times.",
    ),
    (
        "Instruction Tuning with Synthetic Data",
        "A student tuned on teacher-generated instructions "
        "filtered by a quality score beats one tuned on all of them.",
    ),
    (
        "Bias in Resume Screening",
        "Identical resumes with different names get ratings that differ "
        "by up to 8% across name groups in five models.",
    ),
    (
        "Early Exit for Faster Decoding",
        "Letting confident tokens leave at intermediate layers "
        "makes translation decoding 1.7 times faster at equal quality.",
    ),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # A tiny random model that borrows the default model's tokenizer (text in, text out).
    path = build_tiny_model(
        "llama", tmp_path_factory.mktemp("so"), vocab_size=49152, eos_token_id=2, bos_token_id=1
    )
    default = fetch_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default / name).exists():
            shutil.copy(default / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(model=str(tiny_dir), max_model_len=256, max_num_seqs=16)


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ----- validation and compilation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("structured", "problem"),
    [
        ({}, "exactly one of the keys"),
        ({"json": {}, "regex": "a"}, "exactly one of the keys"),
        ({"grammar": "start: x"}, "unknown structured output kind 'grammar'"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": "(ab"}, "unclosed group"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "only strings"),
        ({"json": {"type": "foo"}}, "Invalid type: foo"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "must be a JSON object"),
    ],
)
def test_bad_constraints_are_rejected_at_construction(structured, problem):
    with pytest.raises(InvalidStructuredOutputError, match=re.escape(problem)):
        SamplingParams(structured=structured)
    assert issubclass(InvalidStructuredOutputError, ValueError)


def test_equal_specs_compile_once():
    tokenizer = load_tokenizer(fetch_default_model())
    compiler = GrammarCompiler(tokenizer, 49152, [2])
    schema = review_response_format()["json_schema"]["schema"]
    for _ in range(5):  # a fresh, equal dict each time, as the digest sends it
        compiler.matcher(parse_spec({"json": json.loads(json.dumps(schema))}))
    compiler.matcher(parse_spec({"regex": "[a-z]+"}))
    assert (compiler.misses, compiler.hits) == (2, 4)


def test_eos_is_allowed_exactly_when_the_grammar_accepts():
    tokenizer = load_tokenizer(fetch_default_model())
    compiler = GrammarCompiler(tokenizer, 49152, [2])
    matcher = compiler.matcher(parse_spec({"regex": "a(b)?"}))

    def allowed() -> set[int]:
        mask = fill_grammar_mask([matcher], compiler.bitmask_words)
        bits = (mask.bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return set(bits.flatten().nonzero().flatten().tolist())

    assert 2 not in allowed()  # nothing produced yet: not accepting
    assert matcher.accept(tokenizer.convert_tokens_to_ids("a"))
    assert allowed() == {2, tokenizer.convert_tokens_to_ids("b")}
    assert not matcher.terminated
    assert matcher.accept(tokenizer.convert_tokens_to_ids("b"))
    assert matcher.terminated  # "ab" is complete: the request ends without sampling EOS


def test_mask_touches_only_constrained_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 4  # token 36 only
    apply_grammar_mask(logits, GrammarMask([1], bitmask))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert logits[1, 36] == before[1, 36]
    assert torch.isinf(logits[1]).sum() == 69


# ----- the engine, tiny random model -------------------------------------------------------------


def test_constrained_and_unconstrained_rows_do_not_affect_each_other(tiny):
    prompts = ["Name an animal.", "Tell me a story."]
    constrained = _greedy(structured={"json": SMALL_SCHEMA})
    free = _greedy()
    alone = [
        tiny.generate([prompts[0]], constrained)[0].outputs[0].token_ids,
        tiny.generate([prompts[1]], free)[0].outputs[0].token_ids,
    ]
    together = tiny.generate(prompts, [constrained, free])
    assert [r.outputs[0].token_ids for r in together] == alone
    data = json.loads(together[0].outputs[0].text)
    assert set(data) == {"id", "label", "ok"} and together[0].outputs[0].finish_reason == "stop"


def test_regex_and_choice_are_obeyed(tiny):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["apple pie", "banana", "cherry tart"]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured=structured)
        for s in range(4)
        for structured in ({"regex": pattern}, {"choice": choices})
    ]
    results = tiny.generate(["Answer:"] * len(params), params)
    for i, result in enumerate(results):
        out = result.outputs[0]
        assert out.finish_reason == "stop"
        if i % 2 == 0:
            assert re.fullmatch(pattern, out.text), out.text
        else:
            assert out.text in choices


def test_n_samples_each_follow_the_grammar(tiny):
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=24, structured={"json": SMALL_SCHEMA}
    )
    result = tiny.generate(["Describe a pet as JSON."], params)[0]
    texts = [o.text for o in result.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1  # independent samples
    for o in result.outputs:
        assert o.finish_reason == "stop"
        assert set(json.loads(o.text)) == {"id", "label", "ok"}


def test_preemption_keeps_the_grammar_state(tiny_dir, tiny):
    prompts = [f"Record {i}: " + "ab " * i for i in range(6)]
    params = _greedy(max_tokens=24, structured={"json": SMALL_SCHEMA})
    expected = [r.outputs[0].token_ids for r in tiny.generate(prompts, params)]
    # 20 blocks of 4 tokens hold two or three of these requests, not six: some are preempted
    # mid-JSON and recomputed; the matcher must not see their tokens again.
    cramped = LLM(model=str(tiny_dir), max_model_len=256, num_kv_blocks=20, block_size=4)
    results = cramped.generate(prompts, params)
    assert cramped.engine.core.scheduler.num_preemptions > 0
    assert [r.outputs[0].token_ids for r in results] == expected
    for r in results:
        assert set(json.loads(r.outputs[0].text)) == {"id", "label", "ok"}


# ----- the default model writes digest reviews ---------------------------------------------------


def test_default_model_reviews_all_validate():
    llm = LLM(model="default", max_num_seqs=32)
    fmt = review_response_format()["json_schema"]["schema"]
    conversations = [
        review_messages(f"Title: {title}\n\nAbstract:\n{abstract}", "abstract")
        for title, abstract in SHORT_PAPERS
    ]
    # The constraint guarantees the syntax; finishing inside max_tokens is the model's part. At
    # plain greedy this 135M model loops inside a string or list until max_tokens, so mild
    # penalties are used here to let it close the object.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=600,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        structured={"json": fmt},
    )
    results = llm.chat(conversations, params)
    assert len(results) == 20
    for result in results:
        out = result.outputs[0]
        assert out.finish_reason == "stop", out.text
        Review.model_validate(json.loads(out.text), strict=True)


def test_structured_bench_runs_every_side(tiny_dir, tmp_path):
    from digest.review_bench import StructuredBenchConfig, run_structured_bench

    model = tmp_path / "model"  # the tiny model with room for a review prompt
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    out = tmp_path / "bench.json"
    papers = Path(__file__).parents[2] / "examples" / "papers-2026-03-sample.jsonl"
    cfg = StructuredBenchConfig(
        model=str(model),
        papers=str(papers),
        num_papers=2,
        max_tokens=8,
        json_out=str(out),
        max_batch=4,
    )
    report = run_structured_bench(cfg, echo=lambda _: None)
    assert [s["name"] for s in report["sides"]] == ["constrained", "free, same lengths", "free"]
    assert report["sides"][0]["output_tokens"] == report["sides"][1]["output_tokens"]
    assert report["constrained_over_free_tokens_per_s"] > 0
    assert report["reviews_constrained"]["n"] == 2
    assert json.loads(out.read_text())["machine"]["llguidance"]


def test_objects_that_list_their_properties_are_closed():
    """JSON Schema leaves objects open; a small model then invents keys. Closed unless the
    schema opens them itself; schemas without properties (json_object) stay open; a property
    that happens to be named "properties" is a name, not a keyword."""
    from engine.structured.grammar import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"d": {"anyOf": [{"properties": {"y": {}}}, {"type": "string"}]}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert set(props) == {"properties", "tags", "free", "open"}  # no property was added
    assert props["properties"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["open"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
