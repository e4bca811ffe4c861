"""`nightshift bench accuracy` on a tiny random model with a small byte-level BPE tokenizer
trained on the sample abstracts: its perplexity against HF transformers' (float32), greedy
agreement, the llama.cpp step (with a stand-in binary), the table, the JSON and the exit codes."""

from __future__ import annotations

import json
import math
import stat
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from typer.testing import CliRunner

import engine.accuracy_bench as bench
from digest.sources.local_file import load_papers_file
from engine.accuracy_bench import AccuracyBenchConfig, agreement, run_accuracy_bench
from engine.config import EngineConfig
from nightshift.cli import app
from tests.engine.tiny_models import build_tiny_model, load_hf

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "papers-2026-03-sample.jsonl"
LLAMA_CTX = 64
NUM_ABSTRACTS = 3


def _abstracts(n: int | None = None) -> list[str]:
    return [p.abstract for p in load_papers_file(SAMPLE, n)]


def _byte_bpe(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Ids 0 and 1 are <s> and </s>, as the tiny models' bos and eos."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = build_tiny_model(
        "llama", tmp_path_factory.mktemp("accuracy"), max_position_embeddings=2048
    )
    _byte_bpe(_abstracts(), vocab_size=384).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fake_llama(tmp_path_factory) -> Path:
    """Prints what llama-perplexity prints (to stderr, as its LOG_INF does) and its arguments."""
    path = tmp_path_factory.mktemp("llama") / "llama-perplexity"
    path.write_text(
        "#!/bin/sh\n"
        'echo "args: $*"\n'
        'echo "perplexity: calculating perplexity over 7 chunks, n_ctx=64, batch_size=256" >&2\n'
        'echo "[1]9.8,[2]10.1," >&2\n'
        'echo "Final estimate: PPL = 12.3456 +/- 0.78901" >&2\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _cfg(model_dir: Path, **overrides) -> AccuracyBenchConfig:
    base = dict(
        model=str(model_dir),
        papers=str(SAMPLE),
        num_abstracts=NUM_ABSTRACTS,
        num_prompts=4,
        max_tokens=12,
        device="cpu",
        llama_perplexity="",
    )
    return AccuracyBenchConfig(**(base | overrides))


@pytest.fixture(scope="module")
def report(model_dir, fake_llama, tmp_path_factory) -> dict:
    gguf = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # only passed on to the stand-in binary
    cfg = _cfg(
        model_dir,
        formats=["none", "none"],
        llama_perplexity=str(fake_llama),
        llama_gguf=str(gguf),
        llama_ctx=LLAMA_CTX,
    )
    return run_accuracy_bench(cfg, echo=lambda line: None)


@torch.inference_mode()
def _hf_nll(hf, prompt: list[int], first_scored: int = 1) -> tuple[float, int]:
    logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    targets = torch.tensor(prompt[first_scored:])
    picked = logprobs[first_scored - 1 : len(prompt) - 1].gather(1, targets[:, None])
    return -picked.sum().item(), len(targets)


def test_perplexity_equals_hf(model_dir, report):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = load_hf(model_dir)
    nll, n = 0.0, 0
    for text in _abstracts(NUM_ABSTRACTS):
        a, b = _hf_nll(hf, tok.encode(text))
        nll, n = nll + a, n + b
    ours = report["results"][0]
    assert report["text"]["truncated"] == 0
    assert ours["format"] == "none" and ours["scored_tokens"] == n > 300
    assert ours["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)


def test_llama_chunked_perplexity_equals_hf(model_dir, report):
    """The engine's side of the llama.cpp comparison: whole chunks of -c tokens of the joined
    abstracts, each scored from ctx // 2 + 1 on, as llama-perplexity scores them."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tokens = tok.encode("\n".join(_abstracts(NUM_ABSTRACTS)))
    chunks = torch.tensor(tokens[: len(tokens) // LLAMA_CTX * LLAMA_CTX]).view(-1, LLAMA_CTX)
    first = LLAMA_CTX // 2 + 1
    with torch.inference_mode():
        logprobs = torch.log_softmax(load_hf(model_dir)(chunks).logits.float(), dim=-1)
    picked = logprobs[:, first - 1 : -1].gather(2, chunks[:, first:, None])
    nll, n = -picked.sum().item(), picked.numel()
    ref = report["llama_cpp"]
    assert ref["ours_chunks"] == len(tokens) // LLAMA_CTX
    assert ref["ours_scored_tokens"] == n == ref["ours_chunks"] * (LLAMA_CTX // 2 - 1)
    assert ref["ours_ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)


def test_llama_perplexity_output_is_parsed(report):
    ref = report["llama_cpp"]
    assert ref["error"] is None and ref["skipped"] is None
    assert (ref["llama_ppl"], ref["llama_ppl_stderr"], ref["llama_chunks"]) == (12.3456, 0.78901, 7)
    command = ref["command"]
    assert command[command.index("-c") + 1] == str(LLAMA_CTX)
    assert command[command.index("-m") + 1].endswith("tiny.gguf")


def test_same_format_twice_agrees_fully(report):
    first, again = report["results"]
    assert [first["format"], again["format"]] == ["none", "none"]
    for r in (first, again):
        assert r["agreement"] == 1.0
        assert r["mean_first_divergence"] == 12.0 and r["first_divergence"] == [12] * 4
    assert again["delta_pct"] == pytest.approx(0.0, abs=1e-6)
    assert again["weight_bytes"] == first["weight_bytes"] > 0


def test_agreement_counts_up_to_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = agreement(ref, [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got.first_divergence == [2, 4]
    assert got.fraction == 6 / 8  # the matching 4 after the divergence does not count
    assert got.mean_first_divergence == 3.0


def test_reference_runs_first_and_a_rejected_format_is_its_own_row(model_dir, monkeypatch):
    real = bench.LLM

    def llm(*args, **options):
        if options.get("quantization") == "int8":
            raise ValueError("int8 weights are not supported here")
        return real(*args, **options)

    monkeypatch.setattr(bench, "LLM", llm)
    lines: list[str] = []
    cfg = _cfg(model_dir, formats=["int8", "none"], num_abstracts=2, num_prompts=2)
    out = run_accuracy_bench(cfg, echo=lines.append)
    assert [r["format"] for r in out["results"]] == ["none", "int8"]
    assert out["results"][1]["error"] == "ValueError: int8 weights are not supported here"
    assert any(ln.startswith("int8") and "error: ValueError: int8" in ln for ln in lines)
    assert lines[-1].startswith("llama.cpp reference skipped: no llama-perplexity")


def test_cli_prints_the_table_and_writes_json(model_dir, tmp_path):
    out = tmp_path / "accuracy.json"
    args = ["bench", "accuracy", "--model", str(model_dir), "--papers", str(SAMPLE)]
    args += ["--num-abstracts", "2", "--num-prompts", "2", "--max-tokens", "4", "--device", "cpu"]
    args += ["--format", "none", "--llama-perplexity", "", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("format"))
    for column in ("perplexity", "Δ% vs fp32", "agreement", "1st div", "load s", "greedy s"):
        assert column in lines[header]
    row = lines[header + 1].split()
    assert row[0] == "none" and float(row[1]) > 1 and row[2] == "reference" and row[3] == "1.000"
    report = json.loads(out.read_text())
    assert report["results"][0]["perplexity"] == pytest.approx(float(row[1]), rel=1e-3)
    assert report["text"]["abstracts"] == 2 and report["llama_cpp"]["skipped"]


def _kv_case() -> tuple[str, list[str]]:
    """Before the engine has kv_cache_dtype every kv: format names the missing field; after,
    a kv dtype it does not know is refused by its own rule."""
    if "kv_cache_dtype" not in {f.name for f in fields(EngineConfig)}:
        return "kv:fp8", ["format 'kv:fp8' needs EngineConfig.kv_cache_dtype"]
    return "kv:int3", ["unknown format 'kv:int3'", "kv_cache_dtype must be one of"]


@pytest.mark.parametrize(
    ("fmt", "words"),
    [("int9", ["unknown format 'int9'", "quantization must be one of"]), _kv_case()],
)
def test_cli_unknown_format_is_one_line_and_exit_2(model_dir, fmt, words):
    args = ["bench", "accuracy", "--model", str(model_dir), "--format", fmt, "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.output
    for word in words:
        assert word in errors[0]


def test_a_random_model_is_built_for_the_run_and_kv_formats_keep_their_weights(tmp_path):
    # --model random: a tiny random-weight Llama with the default model's tokenizer, in a
    # temporary folder that is gone after the run; a kv: format changes no weight, so it gets no
    # "was the format applied?" note.
    cfg = _cfg(tmp_path, model="random", formats=["none", "kv:int8"], num_prompts=2, max_tokens=4)
    lines: list[str] = []
    report = run_accuracy_bench(cfg, echo=lines.append)
    assert lines[0].startswith("model: a random-weight Llama")
    assert not Path(report["model_dir"]).exists()
    rows = {r["format"]: r for r in report["results"]}
    assert rows["kv:int8"]["perplexity"] is not None and rows["kv:int8"]["note"] in (None, "")
    assert rows["kv:int8"]["weight_bytes"] == rows["none"]["weight_bytes"]
