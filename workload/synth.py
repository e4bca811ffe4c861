"""A larger (or smaller) night drawn from a recorded one: `nightshift workload synth`.

With kinds (a digest export): N papers, each with one call of every kind present. The recorded
calls are first grouped into papers: calls whose first block after the system prefix has the same
id (a paper prefix visible at this block size), then the rest by input length, since one paper's
calls differ by a fixed task length (the most common difference between a call and the calls of
the first kind shortly before it, +-2 tokens). A synthetic paper resamples a recorded paper whole
(lengths and shared-block count), which keeps the correlation of its calls' lengths. If complete
papers are fewer than half the calls of the commonest kind (the grouping did not work: a few
matches by chance), lengths are drawn per kind from the fitted log-normal instead, the paper prefix
then following export's estimate.

Without kinds (a public trace): N requests resampled from the recorded (input, output) pairs.

hash_ids follow export, at the source's block size (its records' `block_size`, which the output
records carry; a source of mixed sizes is refused as it is read): the source's system blocks (the
longest common prefix of all its hash_ids) are shared by every call, a paper's blocks by its calls,
the rest fresh. Timestamps are 0 (a batch) or a Poisson process at `rate` papers per second; a
paper's calls share its arrival time. Deterministic for a seed."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from workload.export import BlockIds, prompt_blocks
from workload.stats import fit_lognormal
from workload.trace import MAX_TIMESTAMP_MS, TraceRecord, block_size_option_problem

LENGTH_SLACK = (0, -1, 1, -2, 2)  # task-length differences tried when matching by input length
SHIFT_WINDOW = 32  # earlier anchor-kind calls a call is compared with to find the task shift
MIN_COMPLETE = 0.5  # complete papers per call of the commonest kind, to trust the grouping
# The most papers drawn: the records are built in memory (a few hundred bytes and their hash_ids
# each), so the count must not size memory past a laptop's; 100k papers is ~100x a digest night.
MAX_PAPERS = 100_000
Paper = list[TraceRecord]


class SynthError(ValueError):
    """Arguments or a source trace that synth cannot work from; the message says which."""


def common_prefix(lists: Sequence[list[int]]) -> int:
    if not lists:
        return 0
    n = min(len(h) for h in lists)
    first = lists[0]
    for j in range(n):
        if any(h[j] != first[j] for h in lists):
            return j
    return n


def block_size_problem(r: TraceRecord, block_size: int | None = None) -> str | None:
    """Why a source record's hash_ids are not blocks of its block size (or block_size) tokens,
    or None."""
    size = r.hash_block_size if block_size is None else block_size
    if r.hash_ids and len(r.hash_ids) != math.ceil(r.input_length / size):
        return (
            f"{len(r.hash_ids)} hash_ids for {r.input_length} tokens is not "
            f"{size}-token blocks; pass the source's --block-size"
        )
    return None


def check_block_size(records: Sequence[TraceRecord], block_size: int | None) -> None:
    for number, r in enumerate(records, 1):
        if problem := block_size_problem(r, block_size):
            raise SynthError(f"record {number}: {problem}")


def _task_shift(loose: Sequence[TraceRecord], anchor: str, kind: str) -> int | None:
    """The most common input-length difference between a `kind` call and the anchor-kind calls
    just before it: one paper's calls differ by the task alone, and a paper's second call follows
    its first within a few papers (the digest's concurrency)."""
    recent: deque[int] = deque(maxlen=SHIFT_WINDOW)
    diffs: Counter[int] = Counter()
    for r in loose:  # time order
        if r.kind == anchor:
            recent.append(r.input_length)
        elif r.kind == kind:
            diffs.update(r.input_length - length for length in recent)
    return diffs.most_common(1)[0][0] if diffs else None


def _match_by_length(loose: Sequence[TraceRecord], kinds: list[str]) -> list[Paper]:
    """Pair each other kind's call with the earliest free anchor-kind call whose input is shorter
    by the task shift (+- LENGTH_SLACK)."""
    anchors = [r for r in loose if r.kind == kinds[0]]
    papers: list[Paper] = [[r] for r in anchors]
    for kind in kinds[1:]:
        shift = _task_shift(loose, kinds[0], kind)
        if shift is None:
            continue
        free: dict[int, deque[int]] = defaultdict(deque)
        for index, anchor in enumerate(anchors):
            free[anchor.input_length].append(index)
        for r in (r for r in loose if r.kind == kind):
            for slack in LENGTH_SLACK:
                if queue := free.get(r.input_length - shift + slack):
                    papers[queue.popleft()].append(r)
                    break
    return papers


def recorded_papers(records: Sequence[TraceRecord], kinds: list[str], system: int) -> list[Paper]:
    """Complete papers (one call of each kind, kinds in order) found in the records."""
    by_block: dict[int, Paper] = defaultdict(list)
    loose = []
    for r in records:
        if r.kind not in kinds:
            continue
        if len(r.hash_ids) > system:
            by_block[r.hash_ids[system]].append(r)
        else:
            loose.append(r)
    papers = [group for group in by_block.values() if len(group) > 1]
    loose += [group[0] for group in by_block.values() if len(group) == 1]
    loose.sort(key=lambda r: r.timestamp)
    papers += _match_by_length(loose, kinds)
    complete = []
    for paper in papers:
        firsts = {}
        for r in paper:
            firsts.setdefault(r.kind, r)
        if len(firsts) == len(kinds):
            complete.append([firsts[k] for k in kinds])
    return complete


def _arrivals(count: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (ms), all within the trace format's bound: a rate so low that the last paper
    would arrive past 2^53 ms is refused rather than written as a trace no reader takes."""
    if rate is None:
        return np.zeros(count)
    mean_gap = 1000.0 / rate
    if not math.isfinite(mean_gap):
        raise SynthError(f"--rate {rate:g} is too low: the gaps between papers overflow")
    gaps = rng.exponential(mean_gap, size=count)
    gaps[0] = 0.0  # the first paper opens the trace
    stamps = np.round(np.cumsum(gaps), 3)
    if not stamps[-1] <= MAX_TIMESTAMP_MS:  # also NaN
        raise SynthError(
            f"--rate {rate:g} is too low: {count} papers would arrive over {stamps[-1]:.3g} ms, "
            f"past the trace format's {MAX_TIMESTAMP_MS:.3g} ms (2^53)"
        )
    return stamps


def _lognormal_papers(
    records: Sequence[TraceRecord], kinds: list[str], count: int, rng: np.random.Generator
) -> list[list[tuple[int, int]]]:
    """(input, output) per kind per paper, drawn from each kind's fitted log-normal."""
    draws = {}
    for kind in kinds:
        mine = [r for r in records if r.kind == kind]
        sides = []
        for attr in ("input_length", "output_length"):
            values = [getattr(r, attr) for r in mine]
            fit = fit_lognormal(values)
            if fit is None:  # one value or no spread: repeat it
                sides.append(np.full(count, max(1, int(statistics.median(values)))))
            else:
                # Clipped to the longest recorded length: the fit's tail is not data, and an
                # unbounded draw could ask for more tokens than any model's context.
                drawn = rng.lognormal(fit.mu, fit.sigma, size=count)
                sides.append(np.clip(np.rint(drawn), 1, max(values)).astype(int))
        draws[kind] = sides
    return [[(int(draws[k][0][i]), int(draws[k][1][i])) for k in kinds] for i in range(count)]


@dataclass(slots=True)
class _Writer:
    """Builds synthetic papers' records with export's block sharing."""

    stamps: np.ndarray  # arrival time (ms) per paper
    system_len: int  # tokens shared by every call
    block_size: int
    model: str | None
    ids: BlockIds = field(default_factory=BlockIds)

    def paper(
        self, number: int, calls: list[tuple[str | None, int, int]], paper_len: int
    ) -> list[TraceRecord]:
        """The calls (kind, input, output) of paper `number`, sharing paper_len prefix tokens."""
        system = (("system",), self.system_len)
        paper = (("paper", number), paper_len)
        return [
            TraceRecord(
                timestamp=float(self.stamps[number]),
                input_length=length,
                output_length=output,
                hash_ids=prompt_blocks(self.ids, length, self.block_size, system, paper),
                kind=kind,
                model=self.model,
                source="synth",
                block_size=self.block_size,
            )
            for kind, length, output in calls
        ]


def _requests(
    source: list[TraceRecord], writer: _Writer, rng: np.random.Generator
) -> list[TraceRecord]:
    picks = rng.integers(0, len(source), size=len(writer.stamps))
    out = []
    for i, pick in enumerate(picks):
        r = source[pick]
        out += writer.paper(i, [(None, r.input_length, r.output_length)], writer.system_len)
    return out


def _resampled(
    recorded: list[Paper], writer: _Writer, rng: np.random.Generator
) -> list[TraceRecord]:
    picks = rng.integers(0, len(recorded), size=len(writer.stamps))
    out = []
    for i, pick in enumerate(picks):
        paper = recorded[pick]
        shared = common_prefix([r.hash_ids for r in paper]) * writer.block_size
        out += writer.paper(i, [(r.kind, r.input_length, r.output_length) for r in paper], shared)
    return out


def _fitted(
    source: list[TraceRecord], kinds: list[str], writer: _Writer, rng: np.random.Generator
) -> list[TraceRecord]:
    out = []
    for i, lengths in enumerate(_lognormal_papers(source, kinds, len(writer.stamps), rng)):
        inputs = [length for length, _ in lengths]
        estimate = min(inputs) - (max(inputs) - min(inputs))  # export's rule
        calls = [(k, length, output) for k, (length, output) in zip(kinds, lengths)]
        out += writer.paper(i, calls, estimate)
    return out


def synth_trace(
    source: Sequence[TraceRecord],
    papers: int,
    seed: int = 0,
    rate: float | None = None,
    block_size: int | None = None,
) -> tuple[list[TraceRecord], str]:
    """The synthetic records (by timestamp) and a line saying how they were drawn. block_size
    overrides the source's (its records' block_size, else 512); the records carry it."""
    if not 1 <= papers <= MAX_PAPERS:
        raise SynthError(f"--papers must be from 1 to {MAX_PAPERS:,}, not {papers}")
    if seed < 0:  # numpy's generators take only non-negative seeds
        raise SynthError(f"--seed must be a non-negative integer, not {seed}")
    if rate is not None and not (0 < rate < math.inf):
        raise SynthError("--rate must be positive (papers per second)")
    if not source:
        raise SynthError("the source trace has no requests")
    if problem := block_size_option_problem(block_size):
        raise SynthError(problem)
    block_size = source[0].hash_block_size if block_size is None else block_size
    check_block_size(source, block_size)
    ordered = sorted(source, key=lambda r: r.timestamp)
    system = common_prefix([r.hash_ids for r in ordered if r.hash_ids])
    kinds = list(dict.fromkeys(r.kind for r in ordered if r.kind is not None))
    models = Counter(r.model for r in ordered if r.model is not None)
    rng = np.random.default_rng(seed)
    writer = _Writer(
        stamps=_arrivals(papers, rate, rng),
        system_len=system * block_size,
        block_size=block_size,
        model=models.most_common(1)[0][0] if models else None,
    )
    if not kinds:
        note = f"{papers} requests resampled from {len(ordered)} recorded ones"
        return _requests(ordered, writer, rng), note
    recorded = recorded_papers(ordered, kinds, system)
    most = max(Counter(r.kind for r in ordered if r.kind is not None).values())
    if len(recorded) >= MIN_COMPLETE * most:
        note = f"{papers} papers resampled from {len(recorded)} recorded ({', '.join(kinds)})"
        return _resampled(recorded, writer, rng), note
    note = f"{papers} papers drawn from per-kind log-normal fits ({len(recorded)} recorded papers)"
    return _fitted(ordered, kinds, writer, rng), note
