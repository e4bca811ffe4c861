"""`nightshift bench speculative`: what n-gram speculation (and, given one, a draft model) buys
the digest's summary call.

The workload is the digest's summary request: each paper's summary prompt (digest.prompts,
abstract basis: the abstract, then the summary task), greedy, SUMMARY_MAX_TOKENS. Two engines in
one process (three with `draft_model`), identical except for speculation (prefix caching off, so
each computes every prompt), run the same requests alternately, `repeats` times:

- batch 1: one request at a time, as a digest run with one worker issues them;
- batch B: B requests together (max_num_seqs = B), as with B concurrent workers.

Decode tokens/s counts the tokens after the first over the time from the first token to the last
(per request at batch 1; from the last first token to the last finish at batch B), so the prompt's
prefill, which speculation does not touch, stays out. Output tokens/s over the whole wall time is
reported too. Greedy outputs must be token-identical on both sides; the report counts them.

SmolLM2-135M decoding greedily often falls into repeating a sentence until max_tokens, which
prompt lookup predicts very well; a second pass with a frequency penalty (the review call's 0.5)
mostly breaks those loops, so its ratio is the one to expect of non-degenerate text.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from digest.prompts import SUMMARY_MAX_TOKENS, paper_block, summary_messages
from digest.sources.local_file import load_papers_file
from engine.bench import cpu_name
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SpecBenchConfig:
    model: str = "default"
    papers: str = "examples/papers-2026-03-sample.jsonl"  # JSON/JSONL/Atom, as the digest reads
    num_papers: int = 8  # prompts per run; papers repeat when the file has fewer
    max_tokens: int = SUMMARY_MAX_TOKENS
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None  # also run a draft-model side
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    frequency_penalties: list[float] = field(default_factory=lambda: [0.0, 0.5])
    repeats: int = 1
    threads: int | None = None
    json_out: str | None = None


@dataclass(slots=True)
class Run:
    side: str  # "base", "ngram" or "draft"
    batch: int
    frequency_penalty: float
    wall_s: float
    output_tokens: int
    decode_tokens: int  # output tokens after each request's first
    decode_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


def run_spec_bench(cfg: SpecBenchConfig, echo: Callable[[str], None] = print) -> dict:
    papers = load_papers_file(Path(cfg.papers), None)
    if not papers:
        raise ValueError(f"{cfg.papers} holds no papers")
    papers = [papers[i % len(papers)] for i in range(cfg.num_papers)]
    common = dict(
        max_num_seqs=max(cfg.batch_sizes),
        enable_prefix_caching=False,
        num_threads=cfg.threads,
        kv_cache_memory=512 << 20,
    )
    engines = {
        "base": LLM(cfg.model, **common),
        "ngram": LLM(
            cfg.model,
            **common,
            speculative="ngram",
            num_speculative_tokens=cfg.num_speculative_tokens,
            prompt_lookup_min=cfg.prompt_lookup_min,
            prompt_lookup_max=cfg.prompt_lookup_max,
        ),
    }
    if cfg.draft_model:
        engines["draft"] = LLM(
            cfg.model,
            **common,
            speculative="draft",
            num_speculative_tokens=cfg.num_speculative_tokens,
            draft_model=cfg.draft_model,
        )
    base = engines["base"]
    prompts = [
        base.engine.encode_chat(summary_messages(paper_block(p, "abstract", p.abstract)))
        for p in papers
    ]
    echo(f"{len(prompts)} summary prompts, {sum(map(len, prompts))} prompt tokens")
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))

    spec_sides = [side for side in engines if side != "base"]
    runs: list[Run] = []
    identical: dict[str, dict[str, int]] = {side: {} for side in spec_sides}
    acceptance: dict[str, dict[str, dict]] = {side: {} for side in spec_sides}
    for penalty in cfg.frequency_penalties:
        params = SamplingParams(
            temperature=0.0, max_tokens=cfg.max_tokens, frequency_penalty=penalty
        )
        for batch in cfg.batch_sizes:
            before = {side: engines[side].spec_decode_stats() for side in spec_sides}
            outputs: dict[str, list[list[int]]] = {}
            for _ in range(cfg.repeats):
                for side, llm in engines.items():
                    run, results = _timed(llm, side, batch, penalty, prompts, params)
                    runs.append(run)
                    outputs[side] = [r.outputs[0].token_ids for r in results]
                    echo(_row(run))
            key = f"batch {batch}, frequency_penalty {penalty}"
            for side in spec_sides:
                same = sum(a == b for a, b in zip(outputs["base"], outputs[side]))
                stats = _stats_delta(before[side], engines[side].spec_decode_stats())
                identical[side][key], acceptance[side][key] = same, stats
                echo(
                    f"  {side}: identical outputs {same}/{len(prompts)}; acceptance rate "
                    f"{stats['acceptance_rate']:.2f}, mean acceptance length "
                    f"{stats['mean_acceptance_length']:.2f}"
                )
    ratios: dict[str, dict[str, dict[str, float]]] = {side: {} for side in spec_sides}
    for side in spec_sides:
        for penalty in cfg.frequency_penalties:
            for batch in cfg.batch_sizes:
                key = f"batch {batch}, frequency_penalty {penalty}"
                ratios[side][key] = r = {
                    metric: _median(runs, side, batch, penalty, metric)
                    / _median(runs, "base", batch, penalty, metric)
                    for metric in ("decode_tokens_per_s", "output_tokens_per_s")
                }
                echo(
                    f"{side} / base, {key}: decode tok/s x{r['decode_tokens_per_s']:.2f}, "
                    f"output tok/s x{r['output_tokens_per_s']:.2f}"
                )
    report = {
        "config": asdict(cfg),
        "machine": _machine(),
        "runs": [
            asdict(r)
            | {
                "output_tokens_per_s": r.output_tokens_per_s,
                "decode_tokens_per_s": r.decode_tokens_per_s,
            }
            for r in runs
        ],
        # per speculative side ("ngram", and "draft" with a draft model), per setting
        "over_base": ratios,
        "identical_outputs": identical,
        "acceptance": acceptance,
    }
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _timed(
    llm: LLM,
    side: str,
    batch: int,
    penalty: float,
    prompts: list[list[int]],
    params: SamplingParams,
) -> tuple[Run, list[RequestOutput]]:
    results: list[RequestOutput] = []
    decode_s = 0.0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = llm.generate(prompts[i : i + batch], params)
        results += group
        first = max(r.metrics.first_token_time for r in group)
        last = max(r.metrics.finish_time for r in group)
        decode_s += last - first
    wall = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return Run(side, batch, penalty, wall, tokens, tokens - len(results), decode_s), results


def _median(runs: list[Run], side: str, batch: int, penalty: float, metric: str) -> float:
    return statistics.median(
        getattr(r, metric)
        for r in runs
        if r.side == side and r.batch == batch and r.frequency_penalty == penalty
    )


def _stats_delta(before: dict, after: dict) -> dict:
    drafts = after["num_drafts"] - before["num_drafts"]
    proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


def _row(run: Run) -> str:
    return (
        f"{run.side:<6} batch {run.batch:<2} fp {run.frequency_penalty:<4} "
        f"{run.output_tokens:>6} tokens {run.wall_s:>7.1f} s  "
        f"decode {run.decode_tokens_per_s:>6.1f} tok/s  "
        f"output {run.output_tokens_per_s:>6.1f} tok/s"
    )


def _machine() -> dict:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
