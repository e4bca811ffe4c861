"""`nightshift bench structured`: what constrained decoding costs, and what it buys the digest.

The workload is the digest's review call: each paper's review prompt (digest.prompts, abstract
basis), greedy, REVIEW_MAX_TOKENS, optionally with penalties. One engine (prefix caching off, so
every side computes its own prompts) runs, in one process:

- constrained: with the digest's `response_format` schema (engine/structured/);
- free, same lengths: no constraint, `ignore_eos`, each request cut to the length its constrained
  run produced. The two sides decode the same number of tokens per request with the same batch
  shape, so their output tokens/s ratio is the overhead of the grammar (mask fill + apply);
- free: no constraint, as the server behaved before issue 8 ignored `response_format`.

The reviews of the free and the constrained side go through `digest.review_parse.parse_review`:
the two failure rates are "before" and "after".
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import torch

from digest.prompts import REVIEW_MAX_TOKENS, paper_block, review_messages
from digest.review_parse import parse_review, review_response_format
from digest.sources.local_file import load_papers_file
from engine.bench import cpu_name
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class StructuredBenchConfig:
    model: str = "default"
    papers: str = "examples/papers-2026-03-sample.jsonl"  # JSON/JSONL/Atom, as the digest reads
    num_papers: int | None = None  # None: every paper in the file
    max_tokens: int = REVIEW_MAX_TOKENS
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeats: int = 1  # constrained / same-length pairs; the ratio is of their medians
    max_batch: int = 32
    threads: int | None = None
    json_out: str | None = None


@dataclass(slots=True)
class Side:
    name: str
    wall_s: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_structured_bench(cfg: StructuredBenchConfig, echo: Callable[[str], None] = print) -> dict:
    papers = load_papers_file(Path(cfg.papers), cfg.num_papers)
    llm = LLM(
        cfg.model, max_num_seqs=cfg.max_batch, enable_prefix_caching=False, num_threads=cfg.threads
    )
    prompts = [
        llm.engine.encode_chat(review_messages(paper_block(p, "abstract", p.abstract), "abstract"))
        for p in papers
    ]
    echo(f"{len(prompts)} review prompts, {sum(map(len, prompts))} prompt tokens")
    schema = review_response_format()["json_schema"]["schema"]
    # Warm-up, including the one-off costs of the first constrained request (llguidance's
    # tokenizer, the schema's compilation), which the digest pays once per server.
    warm = SamplingParams(temperature=0.0, max_tokens=4, structured={"json": schema})
    llm.generate(prompts[:1], [warm])
    base = dict(
        temperature=0.0,
        max_tokens=cfg.max_tokens,
        frequency_penalty=cfg.frequency_penalty,
        repetition_penalty=cfg.repetition_penalty,
    )
    pairs = []
    for _ in range(cfg.repeats):
        constrained, results = _timed(
            llm, "constrained", prompts, SamplingParams(**base, structured={"json": schema})
        )
        same_params = [
            SamplingParams(**{**base, "max_tokens": len(r.outputs[0].token_ids)}, ignore_eos=True)
            for r in results
        ]
        same, _ = _timed(llm, "free, same lengths", prompts, same_params)
        pairs.append((constrained, same, results))
        echo(_row(constrained))
        echo(_row(same))
    free, free_results = _timed(llm, "free", prompts, SamplingParams(**base))
    echo(_row(free))
    ratio = statistics.median(c.tokens_per_s for c, _, _ in pairs) / statistics.median(
        s.tokens_per_s for _, s, _ in pairs
    )
    report = {
        "config": asdict(cfg),
        "machine": _machine(),
        "sides": [asdict(s) | {"tokens_per_s": s.tokens_per_s} for c, f, _ in pairs for s in (c, f)]
        + [asdict(free) | {"tokens_per_s": free.tokens_per_s}],
        "constrained_over_free_tokens_per_s": ratio,
        "reviews_free": _parse_stats(free_results),
        "reviews_constrained": _parse_stats(pairs[0][2]),
    }
    echo(f"constrained / free output tok/s (same tokens per request): {ratio:.3f}")
    for name in ("reviews_free", "reviews_constrained"):
        echo(f"{name}: {report[name]}")
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _timed(
    llm: LLM, name: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> tuple[Side, list[RequestOutput]]:
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return Side(name, wall, sum(len(r.outputs[0].token_ids) for r in results)), results


def _parse_stats(results: list[RequestOutput]) -> dict:
    """parse_review's verdicts (ok / repaired / failed), finish reasons and the failure rate."""
    statuses = Counter(parse_review(r.outputs[0].text, "abstract").status for r in results)
    finishes = Counter(r.outputs[0].finish_reason for r in results)
    return {
        "n": len(results),
        "ok": statuses["ok"],
        "repaired": statuses["repaired"],
        "failed": statuses["failed"],
        "failure_rate": statuses["failed"] / len(results),
        "finish_reasons": dict(finishes),
    }


def _row(side: Side) -> str:
    return (
        f"{side.name:<20} {side.output_tokens:>7} tokens {side.wall_s:>8.1f} s "
        f"{side.tokens_per_s:>8.1f} tok/s"
    )


def _machine() -> dict:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "llguidance": version("llguidance"),
    }
