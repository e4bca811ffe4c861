"""Speculative decoding: proposals, verification and KV rollback.

Greedy requests must give token for token what decoding without speculation gives, whatever the
proposer (n-gram lookup; a draft model that is usually wrong; the target as its own draft, always
right), the batch size, chunked prefill or preemption. Sampled requests must keep the target's
distribution (a chi-square test on a small vocabulary). Blocks of rejected drafts go back to the
pool.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.sampler import SamplingRow
from engine.spec.ngram import propose_ngram
from engine.spec.rejection_sampler import RejectionSampler
from tests.engine.server.live_server import build_chat_model, live_server
from tests.engine.tiny_models import build_tiny_model

VOCAB = 384


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": build_tiny_model("llama", root / "target"),
        # Another random model: its guesses are nearly always rejected.
        "draft": build_tiny_model("llama", root / "draft", seed=7, num_hidden_layers=1),
    }


def _prompts(n: int = 8) -> list[list[int]]:
    """Prompts with a repeated phrase (n-gram lookup finds matches) and a random tail."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 9))]
        tail = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))]
        out.append(phrase * rng.randrange(2, 5) + tail)
    return out


def _params() -> list[SamplingParams]:
    """Greedy, with the features verification must replay per draft position: penalties,
    min_tokens over EOS, stop token ids, different lengths."""
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=33, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=25, min_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 11, 13]),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]


def _spec_options(kind: str, models: dict[str, Path]) -> dict:
    if kind == "ngram":
        return {"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = models["target"] if kind == "self-draft" else models["draft"]
    return {"speculative": "draft", "draft_model": str(draft)}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    llm = LLM(str(models["target"]), num_kv_blocks=256, block_size=4)
    return _tokens(llm, _prompts(), _params())


# ----- n-gram proposals --------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    # suffix [1, 2, 3] occurs at 0 (followed by 9) and [2, 3] also at 5 (followed by 8): the
    # longer match wins.
    tokens = [1, 2, 3, 9, 9, 2, 3, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 3, 2) == [9, 9]
    assert propose_ngram(tokens, 2, 2, 3) == [8, 5, 1]  # n = 2 only: the latest [2, 3]
    assert propose_ngram(tokens, 1, 3, 10) == [9, 9, 2, 3, 8, 5, 1, 2, 3]  # up to the end
    assert propose_ngram([4, 5, 6, 7], 1, 3, 4) == []  # nothing recurs
    assert propose_ngram([4, 4], 1, 3, 4) == [4]  # overlapping with the suffix is fine
    assert propose_ngram([4], 1, 3, 4) == [] and propose_ngram(tokens, 2, 3, 0) == []


# ----- greedy equality ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ngram", "draft", "self-draft"])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_greedy_output_is_identical_with_speculation(models, reference, kind, max_num_seqs):
    llm = LLM(
        str(models["target"]),
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=max_num_seqs,
        # Small steps: prompts prefill in chunks next to requests verifying drafts, and the
        # budget cuts some drafts short.
        max_num_batched_tokens=24,
        num_speculative_tokens=3,
        **_spec_options(kind, models),
    )
    assert _tokens(llm, _prompts(), _params()) == reference
    stats = llm.spec_decode_stats()
    assert stats["num_draft_tokens"] > 0
    if kind == "self-draft":
        # The target agrees with itself, except where penalties and min_tokens (which the
        # draft's plain argmax does not apply) move the target's choice.
        assert stats["acceptance_rate"] > 0.8
    elif kind == "draft":
        assert stats["acceptance_rate"] < 0.5
    else:
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    core = llm.engine.core
    assert core.kv.pool.num_free == core.num_blocks  # everything went back
    core.kv.check_integrity()


def test_triton_kernels_verify_drafts_too(models, reference):
    """The GPU path: verification chunks through the Triton attention and KV-write kernels
    (interpreted on CPU, see conftest), against the torch path without speculation."""
    llm = LLM(
        str(models["target"]),
        num_kv_blocks=256,
        block_size=4,
        attention_backend="triton",
        num_speculative_tokens=3,
        **_spec_options("ngram", models),
    )
    assert _tokens(llm, _prompts(4), _params()[:4]) == reference[:4]
    assert llm.spec_decode_stats()["num_accepted_tokens"] > 0


def test_greedy_equality_survives_preemption(models, reference):
    llm = LLM(
        str(models["target"]),
        num_kv_blocks=40,  # 160 tokens for 8 requests of up to ~80: preemptions are certain
        block_size=4,
        max_num_seqs=8,
        **_spec_options("self-draft", models),
    )
    assert _tokens(llm, _prompts(), _params()) == reference
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv.pool.num_free == 40


def test_rejected_drafts_give_their_blocks_back(models):
    llm = LLM(
        str(models["target"]),
        num_kv_blocks=256,
        block_size=4,
        num_speculative_tokens=8,
        **_spec_options("ngram", models),
    )
    engine, core = llm.engine, llm.engine.core
    for i, (prompt, params) in enumerate(zip(_prompts(), _params())):
        engine.add_request(f"r{i}", prompt, params)
    rejected = 0
    while engine.has_unfinished():
        engine.step()
        core.kv.check_integrity()
        for request in core.scheduler.running:
            # The n-gram proposer allocates nothing ahead: a request holds exactly the blocks of
            # its computed tokens, so a rejected draft's block is already free.
            assert len(core.kv.block_ids(request.request_id)) == core.kv.blocks_needed(
                request.num_computed_tokens
            )
            assert request.num_computed_tokens == request.num_tokens - 1
        rejected = core.spec_stats.num_draft_tokens - core.spec_stats.num_accepted_tokens
    assert rejected > 0
    assert core.kv.pool.num_free == 256


# ----- sampled requests --------------------------------------------------------------------------


def _row(temperature: float = 1.0, generator=None, **kw) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(temperature=temperature, **kw),
        generator=generator,
        prompt_token_ids=[0],
        output_token_ids=[],
        stop_token_ids=frozenset(),
    )


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("top_k", [-1, 4])
def test_rejection_sampling_keeps_the_target_distribution(top_k):
    """N identical requests, each verifying drafts [d0, d1]. The first emitted token must follow
    p0 (whether d0 was accepted or replaced), and the token after an accepted d0 must follow p1,
    whether it is an accepted d1 or a replacement. Critical value: chi-square, 5 degrees of
    freedom, p = 0.001 is 20.5 (the seed is fixed, so the test is deterministic)."""
    vocab, n = 6, 40_000
    logits0 = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0])
    logits1 = torch.tensor([-0.3, 1.2, 0.4, 0.0, -2.0, 0.9])
    drafts = [[3, 2]] * n  # d0 = 3 is probable, d1 = 2 less so: both paths are exercised
    temperature = 0.8

    def target(logits):
        scaled = logits / temperature
        if top_k > 0:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
        return scaled.softmax(-1)

    torch.manual_seed(1234)
    rows = [_row(temperature, top_k=top_k) for _ in range(3 * n)]
    logits = torch.stack([logits0, logits1, logits1] * n)  # the third row: the bonus position
    out = RejectionSampler()(logits, rows, drafts)
    first = torch.tensor([t[0] for t in out.token_ids])
    after_d0 = torch.tensor([t[1] for t in out.token_ids if t[0] == 3 and len(t) > 1])
    assert _chi_square(torch.bincount(first, minlength=vocab).float(), target(logits0)) < 20.5
    assert _chi_square(torch.bincount(after_d0, minlength=vocab).float(), target(logits1)) < 20.5
    assert all(a == len(t) - 1 for a, t in zip(out.num_accepted, out.token_ids))
    # Sanity: a sampler that always accepts the draft fails the same test.
    always = torch.full((n,), 3.0)
    assert (
        _chi_square(torch.bincount(always.long(), minlength=vocab).float(), target(logits0)) > 1e3
    )


def test_greedy_and_sampled_rows_verify_together():
    logits = torch.tensor([[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0], [0.0, 0.0, 30.0]])
    rows = [_row(0.0), _row(0.0), _row(1.0), _row(1.0)]
    out = RejectionSampler()(logits, rows, [[1], [2]])
    assert out.token_ids[0] == [1, 0]  # greedy: draft 1 is the argmax, then the bonus argmax
    assert out.token_ids[1][0] == 2 and out.num_accepted == [1, 1]  # p(2) ~ 1


def test_seeded_sampling_with_speculation_is_reproducible(models):
    def run():
        llm = LLM(
            str(models["target"]), num_kv_blocks=256, block_size=4, **_spec_options("ngram", models)
        )
        params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True)
        return _tokens(llm, _prompts(4), params), llm.spec_decode_stats()

    (first, stats), (second, _) = run(), run()
    assert first == second
    assert stats["num_draft_tokens"] > 0


# ----- text, logprobs, structured output, server -------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("spec-chat") / "m", max_position_embeddings=256)


def test_stop_strings_and_logprobs_match_without_speculation(chat_model):
    """Several tokens arrive per step: a stop string completed by one of them cuts the rest."""
    base = LLM(str(chat_model))
    spec = LLM(str(chat_model), speculative="draft", draft_model=str(chat_model))
    probe = base.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=30))
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # something the greedy text does contain
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], logprobs=2)
    want = base.generate(["Once upon a time"], params)[0].outputs[0]
    got = spec.generate(["Once upon a time"], params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert got.stop_reason == stop and len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_constrained_requests_do_not_speculate_but_share_the_batch(chat_model):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(temperature=0.0, max_tokens=20, structured={"json": schema})
    free = SamplingParams(temperature=0.0, max_tokens=20)
    prompts = ["Give a number.", "Tell me a story."]
    base = LLM(str(chat_model), max_num_seqs=4)
    spec = LLM(str(chat_model), max_num_seqs=4, speculative="draft", draft_model=str(chat_model))
    want = [r.outputs[0].token_ids for r in base.generate(prompts, [constrained, free])]
    got = spec.generate(prompts, [constrained, free])
    assert [r.outputs[0].token_ids for r in got] == want
    json.loads(got[0].outputs[0].text)
    assert got[0].metrics.num_draft_tokens == 0  # the constrained one never proposed
    assert got[1].metrics.num_draft_tokens > 0


def test_server_reports_speculation_in_metrics_not_usage(chat_model):
    with live_server(
        chat_model, "tiny", speculative="draft", draft_model=str(chat_model), max_num_seqs=4
    ) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 12,
                "temperature": 0,
            }
            usage = client.post("/v1/chat/completions", json=body).json()["usage"]
            # The same usage as without speculation (drafts are not OpenAI's predictions).
            assert set(usage) == {
                "prompt_tokens",
                "completion_tokens",
                "total_tokens",
                "prompt_tokens_details",
            }
            metrics = client.get("/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("nightshift:spec_decode")
    }
    tiny = '{model_name="tiny"}'
    assert values[f"nightshift:spec_decode_num_draft_tokens_total{tiny}"] > 0
    assert values[f"nightshift:spec_decode_acceptance_rate{tiny}"] == 1.0
    assert values[f"nightshift:spec_decode_mean_acceptance_length{tiny}"] > 1.0
    per_pos = (
        'nightshift:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'
    )
    assert values[per_pos] > 0


# ----- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"speculative": "medusa"}, "speculative must be ngram or draft"),
        ({"speculative": "draft"}, "needs draft_model"),
        ({"draft_model": "x"}, "speculative is not 'draft'"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ],
)
def test_bad_speculative_settings_are_named(options, problem):
    with pytest.raises(ValueError, match=problem):
        EngineConfig(**options).validate()


def test_draft_with_another_vocabulary_is_refused(models, tmp_path):
    other = build_tiny_model("llama", tmp_path / "other", vocab_size=500)
    with pytest.raises(ModelLoadError, match="vocabulary of 500 tokens"):
        LLM(str(models["target"]), speculative="draft", draft_model=str(other))


def test_spec_bench_runs_every_side(chat_model, tmp_path):
    from digest.spec_bench import SpecBenchConfig, run_spec_bench

    model = tmp_path / "model"  # room for a summary prompt
    shutil.copytree(chat_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    papers = Path(__file__).parents[2] / "examples" / "papers-2026-03-sample.jsonl"
    out = tmp_path / "bench.json"
    cfg = SpecBenchConfig(
        model=str(model),
        papers=str(papers),
        num_papers=2,
        max_tokens=8,
        draft_model=str(model),  # its own draft: every greedy draft is accepted
        batch_sizes=[1, 2],
        frequency_penalties=[0.0],
        json_out=str(out),
    )
    report = run_spec_bench(cfg, echo=lambda _: None)
    assert {(r["side"], r["batch"]) for r in report["runs"]} == {
        (side, b) for side in ("base", "ngram", "draft") for b in (1, 2)
    }
    key = "batch 1, frequency_penalty 0.0"
    assert report["identical_outputs"] == {
        "ngram": {key: 2, "batch 2, frequency_penalty 0.0": 2},
        "draft": {key: 2, "batch 2, frequency_penalty 0.0": 2},
    }
    assert report["acceptance"]["draft"][key]["acceptance_rate"] == 1.0
    assert report["over_base"]["ngram"]["batch 2, frequency_penalty 0.0"]["decode_tokens_per_s"] > 0
    assert json.loads(out.read_text())["machine"]["cpu"]


def test_serve_flags_reach_the_engine_config(monkeypatch):
    from typer.testing import CliRunner

    import engine.server.serve
    from nightshift.cli import app

    seen = {}
    monkeypatch.setattr(
        engine.server.serve, "serve", lambda config, *a, **kw: seen.update(c=config)
    )
    args = ["serve", "--speculative", "draft", "--draft-model", "/models/small"]
    args += ["--num-speculative-tokens", "6", "--prompt-lookup-min", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    config = seen["c"]
    assert (config.speculative, config.draft_model, config.num_speculative_tokens) == (
        "draft",
        "/models/small",
        6,
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 4)
