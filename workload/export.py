"""The digest's recorded model calls as a trace: `nightshift workload export`.

Only successful calls are exported: they carry the server's real prompt and completion token
counts. The store keeps token counts, not tokens, so `hash_ids` are reconstructed from the prompt
structure (digest/prompts.py: system text, then the paper, then the task) with shared-prefix lengths
measured from the data itself:

- system prefix S (per model): the median of the positive `cached_tokens` of each paper's first
  call, the first paper excepted: what a prefix cache shared between calls of different papers.
  Without such records, an estimate: the system text's characters / 5 (English BPE text runs 4 to
  5 characters a token, so this errs short). S never exceeds any paper prefix below.
- paper prefix X (per paper, model, prompt version and input basis; only when that paper has two
  or more calls): the positive `cached_tokens` of its later calls (the server measured the hit),
  else min(L) - (max(L) - min(L)) over its prompt lengths L: the shorter prompt minus the task
  difference, which errs short when the shorter task is no longer than the difference (true of the
  summary and review tasks). At most min(L) - 1 and at least S.

Each record carries its block_size. A block (block_size tokens, the last one partial) that lies
entirely inside the system prefix gets the model's shared id for its position; entirely inside the
paper prefix, the paper's shared id; otherwise a fresh id. Ids come from one counter in order of
first use, as in Mooncake traces."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime

from sqlalchemy import Engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from digest.prompts import SYSTEM
from digest.store.database import StoreError, open_database
from digest.store.schema import ModelCallRow
from workload.trace import BLOCK_TOKENS, TraceRecord, block_size_option_problem

CHARS_PER_TOKEN_FLOOR = 5  # for the system-prefix estimate; see the module docstring


class ExportError(ValueError):
    """The database cannot be read or holds nothing to export; the message says which."""


@dataclass(slots=True)
class Call:
    """One successful model call, as much of ModelCallRow as a trace needs."""

    started_at: datetime  # UTC
    run_id: int
    paper_id: str
    kind: str
    model: str
    prompt_version: str
    input_basis: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    @property
    def paper_key(self) -> tuple[str, str, str, str]:
        """Calls with equal keys carry the same system text and paper block."""
        return (self.paper_id, self.model, self.prompt_version, self.input_basis)


def load_calls(url: str, since: date | None = None, runs: set[int] | None = None) -> list[Call]:
    """Successful calls with token counts, oldest first; ExportError for what a user can fix."""
    engine = _open(url)
    query = select(ModelCallRow).where(ModelCallRow.status == "ok")
    if runs:
        query = query.where(ModelCallRow.run_id.in_(sorted(runs)))
    try:
        with Session(engine) as session:
            rows = list(session.scalars(query.order_by(ModelCallRow.id)))
    except SQLAlchemyError as exc:
        first = str(exc.orig if getattr(exc, "orig", None) else exc).splitlines()[0]
        raise ExportError(
            f"cannot read model_calls from {_shown(url)} ({first}); is it a digest database?"
        ) from None
    finally:
        engine.dispose()
    calls = [_call(row) for row in rows if row.prompt_tokens is not None]
    if since is not None:
        start = datetime(since.year, since.month, since.day, tzinfo=UTC)
        calls = [c for c in calls if c.started_at >= start]
    calls.sort(key=lambda c: c.started_at)  # stable: equal times keep id order
    return calls


def _open(url: str) -> Engine:
    # create=False: exporting from a SQLite file that is not there is a typo, not a new database.
    try:
        return open_database(url, create=False)
    except StoreError as exc:
        raise ExportError(str(exc)) from None
    except (ImportError, SQLAlchemyError, TypeError) as exc:  # no driver, a bad option
        raise ExportError(f"cannot open {_shown(url)}: {exc}") from None


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _call(row: ModelCallRow) -> Call:
    started = row.started_at
    if started.tzinfo is None:  # SQLite returns naive datetimes; the store writes UTC
        started = started.replace(tzinfo=UTC)
    return Call(
        started_at=started,
        run_id=row.run_id,
        paper_id=row.paper_id,
        kind=row.kind,
        model=row.model,
        prompt_version=row.prompt_version,
        input_basis=row.input_basis,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens or 0,
        cached_tokens=row.cached_tokens,
    )


def system_estimate() -> int:
    return len(SYSTEM) // CHARS_PER_TOKEN_FLOOR


def paper_prefixes(calls: list[Call]) -> dict[tuple, int]:
    """Shared-prefix length (system included) per paper key with two or more calls."""
    by_paper: dict[tuple, list[Call]] = defaultdict(list)
    for call in calls:
        by_paper[call.paper_key].append(call)
    prefixes = {}
    for key, group in by_paper.items():
        if len(group) < 2:
            continue
        lengths = [c.prompt_tokens for c in group]
        measured = max((c.cached_tokens or 0) for c in group[1:])
        shortest = min(lengths)
        estimate = shortest - (max(lengths) - shortest)
        prefixes[key] = max(0, min(measured if measured > 0 else estimate, shortest - 1))
    return prefixes


def system_prefixes(calls: list[Call], papers: dict[tuple, int]) -> dict[str, int]:
    """Shared system-prefix length per model, never longer than any of its paper prefixes."""
    firsts: dict[str, dict[tuple, Call]] = defaultdict(dict)
    for call in calls:
        firsts[call.model].setdefault(call.paper_key, call)
    result = {}
    for model, first_calls in firsts.items():
        hits = [c.cached_tokens for c in list(first_calls.values())[1:] if c.cached_tokens]
        length = int(statistics.median(hits)) if hits else system_estimate()
        bounds = [x for key, x in papers.items() if key[1] == model]
        result[model] = min([length, *bounds])
    return result


class BlockIds:
    """Hands out block ids: a shared name gets the same id each time, None a fresh one."""

    def __init__(self) -> None:
        self.next_id = 0
        self.named: dict[tuple, int] = {}

    def get(self, name: tuple | None) -> int:
        if name is not None and name in self.named:
            return self.named[name]
        block_id, self.next_id = self.next_id, self.next_id + 1
        if name is not None:
            self.named[name] = block_id
        return block_id


def prompt_blocks(
    ids: BlockIds,
    length: int,
    block_size: int,
    system: tuple[tuple, int],
    paper: tuple[tuple, int],
) -> list[int]:
    """Block ids of a prompt of `length` tokens whose first system[1] tokens are shared under
    the name system[0] and first paper[1] tokens (system included) under paper[0]."""
    system_name, system_len = system
    paper_name, paper_len = paper
    system_len = min(system_len, length - 1)
    paper_len = max(min(paper_len, length - 1), system_len)
    blocks = []
    for j in range(math.ceil(length / block_size)):
        end = (j + 1) * block_size
        if end <= system_len:
            name = (*system_name, j)
        elif end <= paper_len:
            name = (*paper_name, j)
        else:
            name = None
        blocks.append(ids.get(name))
    return blocks


def export_trace(calls: list[Call], block_size: int = BLOCK_TOKENS) -> list[TraceRecord]:
    """Calls (oldest first) as trace records; see the module docstring for `hash_ids`."""
    if problem := block_size_option_problem(block_size):
        raise ExportError(problem)
    if not calls:
        return []
    papers = paper_prefixes(calls)
    systems = system_prefixes(calls, papers)
    origin = calls[0].started_at
    ids = BlockIds()
    records = []
    for call in calls:
        hash_ids = prompt_blocks(
            ids,
            call.prompt_tokens,
            block_size,
            (("system", call.model), systems[call.model]),
            (("paper", *call.paper_key), papers.get(call.paper_key, 0)),
        )
        records.append(
            TraceRecord(
                timestamp=round((call.started_at - origin).total_seconds() * 1000, 3),
                input_length=call.prompt_tokens,
                output_length=call.completion_tokens,
                hash_ids=hash_ids,
                kind=call.kind,
                cached_tokens=call.cached_tokens,
                model=call.model,
                source="digest",
                block_size=block_size,
            )
        )
    return records
