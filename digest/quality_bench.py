"""`nightshift bench digest-quality`: the digest run end to end on real papers (a fresh store, the
digest's own prompts, calls, parsing and post-processing), then the figures of digest/quality.py
counted over what it stored. The same command before and after a change of prompt or of
post-processing gives the two columns of docs/PERFORMANCE.md."""

from __future__ import annotations

import json
import platform
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from pathlib import Path

from digest.endpoint import LOCAL
from digest.pipeline import RunOptions, run_digest
from digest.prompts import PROMPT_VERSION
from digest.quality import QualityFigures, measure
from digest.review import Review
from digest.store.database import open_database
from digest.store.digest_store import DigestStore, WorkKey
from engine.bench import cpu_name

# The 500 real cs.CL papers of March 2026 (CC0) that the shared data folder holds.
DEFAULT_PAPERS = (
    Path(__file__).resolve().parents[1].parent
    / "shared/data/arxiv"
    / ("arxiv_papers_cs_2026-03.json")
)
BENCH_DATE = date(2026, 3, 31)  # any fixed date: the store is the bench's own


class NoPapersFile(ValueError):
    """No --papers given and the shared data file is not there."""


@dataclass(slots=True)
class QualityBenchConfig:
    papers: str | None = None  # None: DEFAULT_PAPERS
    num_papers: int = 50
    endpoint: str = LOCAL
    model: str | None = None
    api_key_env: str | None = None
    local_model: str = "default"
    local_server_args: tuple[str, ...] = ()
    concurrency: int = 4
    work_dir: str | None = None  # keeps the store and pages; None: a temporary folder
    json_out: str | None = None
    # Count what an earlier (or still running) bench left in work_dir, without running; only
    # the papers done in every store of `common_with` too, so that two sides compare alike.
    measure_only: bool = False
    common_with: tuple[str, ...] = ()


def papers_path(cfg: QualityBenchConfig) -> Path:
    if cfg.papers:
        return Path(cfg.papers)
    if DEFAULT_PAPERS.is_file():
        return DEFAULT_PAPERS
    raise NoPapersFile(
        f"no --papers given and the default {DEFAULT_PAPERS} is not there: pass a papers "
        "file (JSON/JSONL/Atom, as `digest run --source` reads)"
    )


def run_quality_bench(cfg: QualityBenchConfig, echo: Callable[[str], None] = print) -> dict:
    if cfg.measure_only:
        return _measure_only(cfg, echo)
    path = papers_path(cfg)
    if cfg.work_dir is None:
        with tempfile.TemporaryDirectory(prefix="nightshift-quality-") as tmp:
            return _run(cfg, path, Path(tmp), echo)
    work = Path(cfg.work_dir)
    if work.exists() and any(work.iterdir()):
        # A store with results of this prompt version would be reused, not measured.
        raise ValueError(f"--work-dir {work} is not empty: the bench needs a fresh store")
    work.mkdir(parents=True, exist_ok=True)
    return _run(cfg, path, work, echo)


def _run(cfg: QualityBenchConfig, path: Path, work: Path, echo: Callable[[str], None]) -> dict:
    db_url = f"sqlite:///{work / 'quality.db'}"
    options = RunOptions(
        digest_date=BENCH_DATE,
        out_dir=work / "out",
        source=str(path),
        max_papers=cfg.num_papers,
        endpoint=cfg.endpoint,
        model=cfg.model,
        api_key_env=cfg.api_key_env,
        local_model=cfg.local_model,
        local_server_args=cfg.local_server_args,
        concurrency=cfg.concurrency,
        db_url=db_url,
    )
    echo(f"digest of {cfg.num_papers} papers from {path} (prompt {PROMPT_VERSION})")
    report = run_digest(options)
    for line in report.lines():
        echo(line)
    figures = measure_store(DigestStore(open_database(db_url)), BENCH_DATE, report.run_id)
    _print(figures, echo)
    result = {
        "config": asdict(cfg) | {"papers": str(path)},
        "prompt_version": PROMPT_VERSION,
        "machine": _machine(),
        "run": {
            "wall_s": report.wall_s,
            "calls": report.calls,
            "prompt_tokens": report.prompt_tokens,
            "completion_tokens": report.completion_tokens,
        },
        "figures": figures.as_dict(),
    }
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _store(work_dir: str) -> DigestStore:
    db = Path(work_dir) / "quality.db"
    if not db.is_file():
        raise ValueError(f"{db} is not there: --measure-only reads a bench's --work-dir")
    return DigestStore(open_database(f"sqlite:///{db}"))


def _done(store: DigestStore) -> set[str]:
    return {item.paper_id for item, _ in store.items(BENCH_DATE) if item.status == "done"}


def _measure_only(cfg: QualityBenchConfig, echo: Callable[[str], None]) -> dict:
    if cfg.work_dir is None:
        raise ValueError("--measure-only needs --work-dir (the bench's store)")
    store = _store(cfg.work_dir)
    only = _done(store)
    for other in cfg.common_with:
        only &= _done(_store(other))
    figures = measure_store(store, BENCH_DATE, only=only if cfg.common_with else None)
    calls = recorded_calls(store, only if cfg.common_with else None)
    echo(f"{cfg.work_dir}: {figures.papers} papers measured")
    _print(figures, echo)
    echo(
        f"model calls {calls['calls']} ({calls['summary_calls']} summary, "
        f"{calls['review_calls']} review), {calls['prompt_tokens']} prompt / "
        f"{calls['completion_tokens']} completion tokens"
    )
    result = {
        "config": asdict(cfg),
        "machine": _machine(),
        "prompt_version": store.load_digest(BENCH_DATE).prompt_version,
        "calls": calls,
        "figures": figures.as_dict(),
    }
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def measure_store(
    store: DigestStore, day: date, run_id: int | None = None, only: set[str] | None = None
) -> QualityFigures:
    """The figures of the date's digest as stored (the calls of `run_id`, or of every run);
    `only`: just these papers."""
    digest = store.load_digest(day)
    if digest is None:
        raise LookupError(f"the store has no digest for {day.isoformat()}")
    if only is not None:
        digest.entries = [e for e in digest.entries if e.paper.arxiv_id in only]
    for entry in digest.entries:
        # As stored, not as today's Review would validate it: a store written by an earlier
        # version of the digest is measured as that version published it.
        key = WorkKey(digest.model, digest.prompt_version, entry.input_basis)
        row = store.review(entry.paper.arxiv_id, key)
        if row is not None and row.review is not None:
            entry.review = Review.model_construct(**row.review)
    finish: dict[str, str | None] = {}
    for call in store.calls(run_id):
        if call.kind == "summary" and call.status == "ok":
            finish[call.paper_id] = call.finish_reason  # the last one counts (a retry)
    # A full-text entry carries the text its summary was made from (DigestEntry.source_text).
    return measure(digest.entries, finish, {})


def recorded_calls(store: DigestStore, only: set[str] | None = None) -> dict:
    """What the stored run cost: its model calls (a looping summary asked again counts twice)
    and their tokens, as the store recorded them; `only`: just these papers."""
    calls = [c for c in store.calls() if only is None or c.paper_id in only]
    return {
        "calls": len(calls),
        "summary_calls": sum(c.kind == "summary" for c in calls),
        "review_calls": sum(c.kind == "review" for c in calls),
        "prompt_tokens": sum(c.prompt_tokens or 0 for c in calls),
        "completion_tokens": sum(c.completion_tokens or 0 for c in calls),
    }


def _print(figures: QualityFigures, echo: Callable[[str], None]) -> None:
    echo(f"{'figure':<40} {'count':>6} {'of':>5} {'share':>7}")
    for name, count, total in figures.rows():
        share = f"{count / total:.0%}" if total else "-"
        echo(f"{name:<40} {count:>6} {total:>5} {share:>7}")
    for kind, shown in figures.examples.items():
        echo(f"examples, {kind}:")
        for text in shown:
            echo(f"  {text}")


def _machine() -> dict:
    import torch

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
