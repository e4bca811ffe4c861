"""Per-request records of a replay and the summary metrics computed from them, with the
definitions of vLLM's serving benchmark (`vllm bench serve`):

- TTFT: time of the first content chunk - send time.
- ITL: the gaps between consecutive content chunks.
- TPOT per request: (E2E - TTFT) / (output tokens - 1); undefined for one-token outputs.
- E2E: end of the response - send time.
- Throughputs: completed requests, their output tokens, and their input + output tokens, each
  divided by the benchmark duration (replay start to the last response).

All times are seconds on the client's `time.perf_counter()` clock, as offsets from the replay's
start. A "content chunk" is a streamed chunk whose text (or chat delta content) is not empty."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2e")  # milliseconds, as given on the command line


@dataclass(slots=True)
class RequestRecord:
    index: int  # the trace record's position
    input_length: int
    output_expected: int
    start_s: float | None = None  # send time; None: never sent
    end_s: float | None = None  # end of the response (or of the failure)
    chunk_times: list[float] = field(default_factory=list)  # content chunks' arrival
    output_received: int | None = None  # usage.completion_tokens, else content chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens, when reported
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error_kind: str | None = None  # http_<status> | timeout | disconnect | too_long | ...
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        if self.start_s is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.start_s

    @property
    def e2e_s(self) -> float | None:
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        ttft, e2e, n = self.ttft_s, self.e2e_s, self.output_received
        if not self.ok or ttft is None or e2e is None or n is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)

    @property
    def output_mismatch(self) -> bool:
        """The server returned another number of tokens than asked (it ignored ignore_eos)."""
        return self.ok and self.output_received != self.output_expected

    def to_json(self) -> dict:
        itl = self.itl
        return {
            "index": self.index,
            "start_s": _round(self.start_s),
            "end_s": _round(self.end_s),
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "e2e_s": _round(self.e2e_s),
            "itl_mean_s": _round(sum(itl) / len(itl)) if itl else None,
            "itl_max_s": _round(max(itl)) if itl else None,
            "chunks": len(self.chunk_times),
            "input_length": self.input_length,
            "prompt_tokens": self.prompt_tokens,
            "output_expected": self.output_expected,
            "output_received": self.output_received,
            "output_mismatch": self.output_mismatch,
            "cached_tokens": self.cached_tokens,
            "error_kind": self.error_kind,
            "error": self.error,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def distribution(values: Sequence[float]) -> dict:
    """mean / median / p90 / p99 (numpy's linear interpolation, as vLLM) and the count."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "count": len(values),
    }


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (send to end); a request ending at the instant another
    starts does not overlap it."""
    events = []
    for r in records:
        if r.start_s is not None and r.end_s is not None:
            events += [(r.start_s, 1), (r.end_s, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # ends (-1) before starts at equal times
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def meets_slo(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """A completed request within every given SLO; an undefined TPOT (one token) violates none."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    for key, limit_ms in slo_ms.items():
        value = values[key]
        if value is None:
            if key == "tpot":
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def throughput_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[float]:
    """Output tokens per second of completed requests in bins of bin_s from the replay's start.
    A request's tokens are spread evenly over its content chunks (a chunk may carry several)."""
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if r.ok and r.chunk_times and r.output_received:
            share = r.output_received / len(r.chunk_times)
            times += r.chunk_times
            weights += [share] * len(r.chunk_times)
    if not times:
        return []
    bins = [0.0] * (int(max(times) // bin_s) + 1)
    for t, w in zip(times, weights):
        bins[int(max(t, 0.0) // bin_s)] += w
    return [b / bin_s for b in bins]


def summarize(
    records: Sequence[RequestRecord],
    *,
    slo_ms: dict[str, float] | None = None,
    not_sent: int = 0,
    bin_s: float = 1.0,
) -> dict:
    """The summary of a replay's records (see the module doc for the definitions)."""
    sent = [r for r in records if r.start_s is not None]
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    ends = [r.end_s for r in sent if r.end_s is not None]
    starts = [r.start_s for r in sent if r.start_s is not None]
    duration = max(ends) if ends else 0.0
    makespan = max(ends) - min(starts) if ends and starts else 0.0
    input_tokens = sum(r.input_length for r in done)
    output_tokens = sum(r.output_received or 0 for r in done)
    failures: dict[str, int] = {}
    for r in failed:
        kind = r.error_kind or "incomplete"
        failures[kind] = failures.get(kind, 0) + 1
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]

    def per_s(value: float) -> float | None:
        return value / duration if duration > 0 else None

    summary = {
        "requests": {
            "total": len(records) + not_sent,
            "sent": len(sent),
            "completed": len(done),
            "failed": len(failed),
            "not_sent": not_sent,
        },
        "failures": failures,
        "duration_s": duration,
        "makespan_s": makespan,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_expected": sum(r.output_expected for r in done),
        "output_mismatch": sum(1 for r in done if r.output_mismatch),
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "peak_concurrency": peak_concurrency(records),
        "ttft_s": distribution([t for r in done if (t := r.ttft_s) is not None]),
        "tpot_s": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "itl_s": distribution([g for r in done for g in r.itl]),
        "e2e_s": distribution([t for r in done if (t := r.e2e_s) is not None]),
        "goodput": None,
        "timeline": {"bin_s": bin_s, "output_tokens_per_s": throughput_timeline(done, bin_s)},
    }
    if slo_ms:
        good = sum(1 for r in done if meets_slo(r, slo_ms))
        summary["goodput"] = {
            "slo_ms": dict(slo_ms),
            "requests": good,
            "request_rate": per_s(good),
            "fraction": good / len(sent) if sent else None,  # of sent requests; failures miss
        }
    return summary


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:500,tpot:50,e2e:10000' (milliseconds) -> {'ttft': 500.0, ...}."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: use ttft:MS, tpot:MS or e2e:MS")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number of ms") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"bad SLO {part!r}: the limit must be a positive number of ms")
        slo[key] = ms
    if not slo:
        raise ValueError("empty SLO: use e.g. ttft:500,tpot:50")
    return slo
