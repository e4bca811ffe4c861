"""`nightshift bench accuracy`: what a weight (or KV-cache) format costs in accuracy, on real text.

Each format runs in its own engine on the same model folder, float32 activations; "none" (the
checkpoint's own float weights) is the reference and always runs first. Two measures:

- Perplexity of N paper abstracts, each scored alone: the engine's prompt logprobs (prefill-only
  requests, prompt_logprobs=0, so each position holds the logprob of the actual next prompt token)
  give the NLL of every token but each abstract's first, which has no context. ppl = exp(mean NLL
  over all scored tokens of all abstracts): longer abstracts weigh more, as in a corpus figure.
- Greedy agreement on M prompts (the first sentence of each abstract), K tokens each with
  ignore_eos: the fraction of positions that match the reference up to each prompt's first
  divergence (after a divergence the two continue from different text, so later matches are not
  agreement), and the mean position of that first divergence.

llama.cpp reference (optional, the default model only): `llama-perplexity` on the abstracts written
one after the other to a file, with the GGUF the default model folder was converted from. It cuts
the token stream into chunks of `-c` tokens and scores only the second half of each (the first half
is context), so its figure is not the per-abstract one; the engine also scores the same stream the
same way, and each figure says what it is. The default folder *is* that GGUF's Q4_1 weights
dequantized to float32, so the two differ by llama.cpp's arithmetic (its CPU dot products quantize
the activations to 8 bits) and by any tokenizer difference (the chunk counts are compared).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from digest.sources.local_file import load_papers_file
from engine.bench import cpu_name
from engine.config import EngineConfig
from engine.cpu_threads import configure_threads
from engine.llm import LLM
from engine.sampling_params import SamplingParams

REFERENCE = "none"
KV_PREFIX = "kv:"
DEFAULT_LLAMA_PERPLEXITY = "/tmp/llamacpp/bin/llama-perplexity"
# Long enough for any abstract (the longest of 500 March 2026 cs papers is ~700 SmolLM2 tokens).
DEFAULT_MAX_MODEL_LEN = 2048
LLAMA_TIMEOUT_S = 3600
# A first sentence ends at . ! or ? followed by space and a capital (or the end): "e.g. the" and
# "3.5 points" do not end it.
_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z(\[]|\s*$)")
_LLAMA_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_LLAMA_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


class UnknownFormatError(ValueError):
    """A --format the engine cannot express: a setup mistake, refused before anything runs."""


@dataclass(slots=True)
class AccuracyBenchConfig:
    model: str = "default"
    papers: str = "examples/papers-2026-03-sample.jsonl"  # JSON/JSONL/Atom, as the digest reads
    num_abstracts: int = 50
    num_prompts: int = 16
    max_tokens: int = 64  # greedy tokens per prompt
    formats: list[str] = field(default_factory=lambda: [REFERENCE])
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # abstracts beyond it are cut (and counted)
    max_num_batched_tokens: int = 1024
    device: str = "auto"
    threads: int | None = None
    # None: $LLAMA_PERPLEXITY, else DEFAULT_LLAMA_PERPLEXITY when it exists; "" never runs it.
    llama_perplexity: str | None = None
    llama_gguf: str | None = None  # None: the default model's own GGUF (--model default only)
    llama_ctx: int = 512
    json_out: str | None = None


# ---- formats -------------------------------------------------------------------------------


def format_options(name: str) -> dict[str, str]:
    """The EngineConfig fields a --format sets: "none" none, "kv:X" kv_cache_dtype=X, any other
    quantization=name. Raises UnknownFormatError naming the field or the engine's own rule."""
    if name == REFERENCE:
        return {}
    if name.startswith(KV_PREFIX):
        option, value = "kv_cache_dtype", name.removeprefix(KV_PREFIX)
    else:
        option, value = "quantization", name
    if option not in {f.name for f in fields(EngineConfig)}:
        raise UnknownFormatError(
            f"format {name!r} needs EngineConfig.{option}, which this engine does not have yet"
        )
    try:  # the engine's own list of values, so the bench never disagrees with it
        EngineConfig(**{option: value}).validate()
    except ValueError as exc:
        raise UnknownFormatError(f"unknown format {name!r}: {exc}") from None
    return {option: value}


def run_order(formats: list[str]) -> list[str]:
    """The reference first (added when absent); the rest in the given order. A repeated format
    runs again in a fresh engine, which checks that a format is deterministic."""
    rest = list(formats)
    if REFERENCE in rest:
        rest.remove(REFERENCE)
    return [REFERENCE, *rest]


# ---- text ----------------------------------------------------------------------------------


def first_sentence(text: str, max_chars: int = 400) -> str:
    match = _SENTENCE_END.search(text)
    sentence = text[: match.end()] if match else text
    return sentence[:max_chars].strip()


@dataclass(slots=True)
class Text:
    abstracts: list[str]
    abstract_tokens: list[list[int]]
    prompt_tokens: list[list[int]]  # the greedy prompts: first sentences
    truncated: int  # abstracts cut at max_model_len


def load_text(cfg: AccuracyBenchConfig, tokenizer, max_model_len: int) -> Text:
    papers = load_papers_file(Path(cfg.papers), max(cfg.num_abstracts, cfg.num_prompts))
    abstracts = [p.abstract for p in papers[: cfg.num_abstracts]]
    tokens = [tokenizer.encode(a) for a in abstracts]
    truncated = sum(len(t) > max_model_len for t in tokens)
    prompts = [tokenizer.encode(first_sentence(p.abstract)) for p in papers[: cfg.num_prompts]]
    return Text(
        abstracts,
        [t[:max_model_len] for t in tokens],
        [p[: max_model_len - cfg.max_tokens] for p in prompts],
        truncated,
    )


# ---- the two measures ----------------------------------------------------------------------


@dataclass(slots=True)
class Perplexity:
    nll: float  # summed over the scored tokens
    tokens: int

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan


def prompt_nll(llm: LLM, prompts: list[list[int]], first_scored: int = 1) -> Perplexity:
    """Summed NLL of each prompt's tokens from position `first_scored` on (each logprob is
    conditioned on the prompt's earlier tokens only), from prefill-only requests."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    nll, tokens = 0.0, 0
    for prompt, result in zip(prompts, llm.generate(prompts, params)):
        entries = result.prompt_logprobs or []
        for pos in range(max(first_scored, 1), len(prompt)):
            nll -= entries[pos][prompt[pos]]
            tokens += 1
    return Perplexity(nll, tokens)


def llama_chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole chunks of ctx tokens (the tail is dropped), each one's
    first token replaced by BOS when the tokenizer adds one. Score from position ctx // 2 + 1."""
    chunks = [tokens[i : i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]
    if bos is not None:
        chunks = [[bos, *chunk[1:]] for chunk in chunks]
    return chunks


def greedy_outputs(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@dataclass(slots=True)
class Agreement:
    positions: int  # reference tokens, summed over prompts
    matched: int  # of those, identical before each prompt's first divergence
    first_divergence: list[int]  # per prompt: first differing position (its length if none)

    @property
    def fraction(self) -> float:
        return self.matched / self.positions if self.positions else math.nan

    @property
    def mean_first_divergence(self) -> float:
        n = len(self.first_divergence)
        return sum(self.first_divergence) / n if n else math.nan


def agreement(reference: list[list[int]], other: list[list[int]]) -> Agreement:
    divergences = []
    for ref, out in zip(reference, other, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        divergences.append(min(len(ref), len(out)) if same is None else same)
    return Agreement(sum(map(len, reference)), sum(divergences), divergences)


# ---- one format ----------------------------------------------------------------------------


@dataclass(slots=True)
class FormatResult:
    format: str
    perplexity: float | None = None
    scored_tokens: int = 0
    delta_pct: float | None = None  # perplexity vs the reference's
    agreement: float | None = None
    mean_first_divergence: float | None = None
    first_divergence: list[int] = field(default_factory=list)
    weight_bytes: int | None = None
    load_s: float = 0.0
    perplexity_s: float = 0.0
    greedy_s: float = 0.0
    error: str | None = None
    note: str | None = None


def _engine(cfg: AccuracyBenchConfig, model_dir: Path, max_model_len: int, **options) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",
        device=cfg.device,
        max_model_len=max_model_len,
        max_num_seqs=max(cfg.num_prompts, 16),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=False,  # every format computes every token itself
        num_threads=cfg.threads,
        **options,
    )


def weight_bytes(llm: LLM) -> int | None:
    """Bytes of the model's weights as the engine holds them (a quantized layout counts its codes
    and scales), each object once: a format whose weights did not shrink was not applied."""
    model = getattr(llm.engine.core.executor, "model", None)
    if model is None:  # weights in worker processes
        return None
    tensors = [model.embed, model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [getattr(layer, f.name) for f in fields(layer)]
    seen = {id(t): t for t in tensors if t is not None and hasattr(t, "nbytes")}
    return sum(int(t.nbytes) for t in seen.values())


def measure_format(
    cfg: AccuracyBenchConfig,
    model_dir: Path,
    max_model_len: int,
    name: str,
    text: Text,
    reference_outputs: list[list[int]] | None,
) -> tuple[FormatResult, list[list[int]]]:
    result = FormatResult(name)
    start = time.perf_counter()
    llm = _engine(cfg, model_dir, max_model_len, **format_options(name))
    try:
        result.load_s = time.perf_counter() - start
        result.weight_bytes = weight_bytes(llm)
        start = time.perf_counter()
        ppl = prompt_nll(llm, text.abstract_tokens)
        result.perplexity_s = time.perf_counter() - start
        result.perplexity, result.scored_tokens = ppl.value, ppl.tokens
        start = time.perf_counter()
        outputs = greedy_outputs(llm, text.prompt_tokens, cfg.max_tokens)
        result.greedy_s = time.perf_counter() - start
    finally:
        llm.shutdown()
    agree = agreement(reference_outputs if reference_outputs is not None else outputs, outputs)
    result.agreement, result.first_divergence = agree.fraction, agree.first_divergence
    result.mean_first_divergence = agree.mean_first_divergence
    return result, outputs


# ---- llama.cpp -----------------------------------------------------------------------------


def find_llama_perplexity(configured: str | None) -> Path | None:
    if configured is not None:
        return Path(configured) if configured else None
    if env := os.environ.get("LLAMA_PERPLEXITY"):
        return Path(env)
    default = Path(DEFAULT_LLAMA_PERPLEXITY)
    return default if default.is_file() else None


@dataclass(slots=True)
class LlamaReference:
    ctx: int
    llama_ppl: float | None = None
    llama_ppl_stderr: float | None = None
    llama_chunks: int | None = None
    llama_s: float = 0.0
    ours_ppl: float | None = None  # the engine, float32, on the same stream and chunks
    ours_chunks: int = 0
    ours_scored_tokens: int = 0
    ours_s: float = 0.0
    command: list[str] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None


def run_llama_reference(
    cfg: AccuracyBenchConfig, model_dir: Path, max_model_len: int, text: Text
) -> LlamaReference:
    ref = LlamaReference(cfg.llama_ctx)
    binary = find_llama_perplexity(cfg.llama_perplexity)
    if binary is None:
        ref.skipped = (
            f"no llama-perplexity (--llama-perplexity, $LLAMA_PERPLEXITY or "
            f"{DEFAULT_LLAMA_PERPLEXITY}; ops/build_llamacpp.sh builds it)"
        )
        return ref
    if not binary.is_file():
        ref.skipped = f"llama-perplexity {binary} does not exist"
        return ref
    gguf = _llama_gguf(cfg)
    if gguf is None:
        ref.skipped = f"--model {cfg.model} has no GGUF known here: pass --llama-gguf"
        return ref
    if cfg.llama_ctx > max_model_len:
        ref.skipped = f"--llama-ctx {cfg.llama_ctx} exceeds max_model_len {max_model_len}"
        return ref
    # One after the other; llama.cpp's -f reader takes the file as it is (less one final newline).
    stream = "\n".join(text.abstracts)
    _ours_chunked(cfg, model_dir, max_model_len, stream, ref)
    if ref.error is not None:
        return ref
    with tempfile.TemporaryDirectory(prefix="nightshift-accuracy-") as tmp:
        path = Path(tmp) / "abstracts.txt"
        path.write_text(stream, encoding="utf-8")
        ref.command = [str(binary), "-m", str(gguf), "-f", str(path), "-c", str(cfg.llama_ctx)]
        ref.command += ["-t", str(cfg.threads or torch.get_num_threads())]
        _run_llama(ref)
    return ref


def _llama_gguf(cfg: AccuracyBenchConfig) -> Path | None:
    if cfg.llama_gguf:
        return Path(cfg.llama_gguf)
    if cfg.model != "default":
        return None
    from engine.model_fetch import locate_gguf

    return locate_gguf()


def _ours_chunked(
    cfg: AccuracyBenchConfig, model_dir: Path, max_model_len: int, stream: str, ref: LlamaReference
) -> None:
    start = time.perf_counter()
    llm = _engine(cfg, model_dir, max_model_len)
    try:
        tokenizer = llm.get_tokenizer()
        # verbose=False: the stream is meant to exceed the model's context; it is cut below.
        tokens = tokenizer.encode(stream, verbose=False)
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokens[:1] == [bos]
        chunks = llama_chunks(tokens, cfg.llama_ctx, bos if adds_bos else None)
        if len(chunks) < 2:  # llama-perplexity's own minimum: 2 * ctx tokens
            ref.error = f"the abstracts are {len(tokens)} tokens, fewer than 2 x {cfg.llama_ctx}"
            return
        ppl = prompt_nll(llm, chunks, first_scored=cfg.llama_ctx // 2 + 1)
    finally:
        llm.shutdown()
    ref.ours_ppl, ref.ours_chunks, ref.ours_scored_tokens = ppl.value, len(chunks), ppl.tokens
    ref.ours_s = time.perf_counter() - start


def _run_llama(ref: LlamaReference) -> None:
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            ref.command, capture_output=True, text=True, timeout=LLAMA_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        ref.error = f"llama-perplexity did not run: {exc}"
        return
    ref.llama_s = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    estimate = _LLAMA_PPL.search(log)
    if proc.returncode != 0 or estimate is None:
        tail = " | ".join(log.strip().splitlines()[-3:])
        ref.error = f"llama-perplexity exited {proc.returncode} without a final estimate: {tail}"
        return
    ref.llama_ppl, ref.llama_ppl_stderr = float(estimate[1]), float(estimate[2])
    if chunks := _LLAMA_CHUNKS.search(log):
        ref.llama_chunks = int(chunks[1])


# ---- the run -------------------------------------------------------------------------------


def run_accuracy_bench(cfg: AccuracyBenchConfig, echo: Callable[[str], None] = print) -> dict:
    """The bench on cfg.model: "default", a local HF folder, or "random" (a tiny random-weight
    Llama with the default model's tokenizer, engine/random_model.py, built in a temporary
    folder for the run)."""
    from engine.model_fetch import resolve_model

    order = run_order(cfg.formats)
    for name in order:  # every format checked before minutes of float32
        format_options(name)
    # Every engine below resolves the same count; llama-perplexity gets it too (-t).
    configure_threads(cfg.threads)
    with tempfile.TemporaryDirectory(prefix="nightshift-random-model-") as tmp:
        if cfg.model == "random":
            from engine.random_model import build_random_model

            model_dir = build_random_model(Path(tmp) / "model")
            echo(f"model: a random-weight Llama with the default model's tokenizer ({model_dir})")
        else:
            model_dir = resolve_model(cfg.model)
        return _run(cfg, model_dir, order, echo)


def _run(
    cfg: AccuracyBenchConfig, model_dir: Path, order: list[str], echo: Callable[[str], None]
) -> dict:
    from engine.models.model_config import load_model_config

    max_model_len = min(cfg.max_model_len, load_model_config(model_dir).max_position_embeddings)
    if cfg.max_tokens >= max_model_len:
        raise ValueError(f"--max-tokens {cfg.max_tokens} leaves no room in {max_model_len} tokens")
    text = _reference_text(cfg, model_dir, max_model_len)
    echo(
        f"{len(text.abstracts)} abstracts from {cfg.papers} "
        f"({sum(map(len, text.abstract_tokens))} tokens, {text.truncated} cut at "
        f"{max_model_len}); {len(text.prompt_tokens)} greedy prompts x {cfg.max_tokens} tokens; "
        f"{cpu_name()}, {torch.get_num_threads()} threads"
    )
    echo(_legend(cfg))
    echo(HEADER)
    results: list[FormatResult] = []
    reference: FormatResult | None = None
    reference_outputs: list[list[int]] | None = None
    for name in order:
        try:
            result, outputs = measure_format(
                cfg, model_dir, max_model_len, name, text, reference_outputs
            )
        except Exception as exc:  # noqa: BLE001 - a format the engine rejects is its own row
            if reference is None:
                raise  # without the reference nothing can be compared
            result = FormatResult(name, error=_one_line(exc))
        else:
            if reference is None:
                reference, reference_outputs = result, outputs
            _compare(result, reference)
        results.append(result)
        echo(_row(result, cfg.max_tokens))
    llama = run_llama_reference(cfg, model_dir, max_model_len, text)
    for line in _llama_lines(llama, cfg, len(text.abstracts)):
        echo(line)
    report = {
        "config": asdict(cfg),
        "model_dir": str(model_dir),
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "text": {
            "abstracts": len(text.abstracts),
            "abstract_tokens": sum(map(len, text.abstract_tokens)),
            "truncated": text.truncated,
            "prompts": len(text.prompt_tokens),
        },
        "perplexity_method": "per abstract, each scored alone, its first token unscored",
        "results": [asdict(r) for r in results],
        "llama_cpp": asdict(llama),
    }
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
        echo(f"wrote {cfg.json_out}")
    return report


def _reference_text(cfg: AccuracyBenchConfig, model_dir: Path, max_model_len: int) -> Text:
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer: the accuracy bench scores text")
    return load_text(cfg, tokenizer, max_model_len)


def _compare(result: FormatResult, reference: FormatResult) -> None:
    if result is reference or result.perplexity is None or reference.perplexity is None:
        return
    result.delta_pct = 100 * (result.perplexity / reference.perplexity - 1)
    weights_format = result.format != REFERENCE and not result.format.startswith(KV_PREFIX)
    if weights_format and result.weight_bytes == reference.weight_bytes:  # kv: keeps the weights
        result.note = "weights as large as the reference's: was the format applied?"


def _legend(cfg: AccuracyBenchConfig) -> str:
    reference = "none: the checkpoint's float weights"
    if cfg.model == "default":
        reference += " (the default model: its GGUF's Q4_1 weights dequantized to float32)"
    return (
        f"perplexity: each abstract scored alone, its first token unscored; agreement: greedy "
        f"tokens equal to the reference's before the first divergence (1st div: its mean "
        f"position, of {cfg.max_tokens}); {reference}"
    )


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


HEADER = (
    f"{'format':<10} {'perplexity':>10} {'Δ% vs fp32':>10} {'agreement':>9} "
    f"{'1st div':>8} {'weights MB':>10} {'load s':>7} {'ppl s':>7} {'greedy s':>8}"
)


def _row(r: FormatResult, max_tokens: int) -> str:
    if r.error is not None:
        return f"{r.format:<10} error: {r.error}"
    delta = "reference" if r.delta_pct is None else f"{r.delta_pct:+.2f}%"
    mb = "?" if r.weight_bytes is None else f"{r.weight_bytes / 1e6:.1f}"
    row = (
        f"{r.format:<10} {r.perplexity:>10.4f} {delta:>10} {r.agreement:>9.3f} "
        f"{r.mean_first_divergence:>8.1f} {mb:>10} {r.load_s:>7.1f} {r.perplexity_s:>7.1f} "
        f"{r.greedy_s:>8.1f}"
    )
    return row + (f"  ({r.note})" if r.note else "")


def _llama_lines(ref: LlamaReference, cfg: AccuracyBenchConfig, n: int) -> list[str]:
    if ref.skipped is not None:
        return [f"llama.cpp reference skipped: {ref.skipped}"]
    half = f"chunks of {ref.ctx} tokens, the second half of each scored"
    lines = [f"llama.cpp reference ({n} abstracts as one stream, {half}):"]
    if ref.ours_ppl is not None:
        weights = (
            "the GGUF's Q4_1 weights dequantized to float32"
            if cfg.model == "default" and not cfg.llama_gguf
            else f"float32 weights of --model {cfg.model}"
        )
        lines.append(
            f"  ours, {weights}, same chunks: PPL "
            f"{ref.ours_ppl:.4f} ({ref.ours_chunks} chunks, {ref.ours_scored_tokens} tokens "
            f"scored, {ref.ours_s:.1f} s)"
        )
    if ref.llama_ppl is not None:
        lines.append(
            f"  llama.cpp llama-perplexity, the GGUF's own weights: PPL {ref.llama_ppl:.4f} "
            f"+/- {ref.llama_ppl_stderr:.4f} ({ref.llama_chunks} chunks, {ref.llama_s:.1f} s)"
        )
    if ref.error is not None:
        lines.append(f"  error: {ref.error}")
    return lines
