"""The engine's own scheduler on a virtual clock.

`simulate` feeds a trace to `engine.scheduler.Scheduler` and `engine.kv.KVCacheManager` - the
code the engine runs, not a model of it - and replaces the forward pass with the performance
model: each step advances the clock by `step_time(shape)` and every sampling row emits a token,
until each request reaches its trace output length (ignore_eos, as a replay forces it). Prompts
are token ids derived from the trace's hash_ids, so equal blocks hit the prefix cache as they do
in a real replay."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from capacity.perf import StepShape
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workload.trace import TraceRecord

_TOKEN = 1  # what the simulated runner "samples"; no stop ids and ignore_eos, so never a stop


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine settings that decide the schedule."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 8192
    enable_prefix_caching: bool = True


MODES = ("batch", "trace", "poisson", "concurrency")


@dataclass(frozen=True, slots=True)
class Load:
    """How requests arrive, as `workload replay --mode` sends them: batch (all at 0), trace (at
    the trace's timestamps), poisson (at `rate` requests/s, seeded exponential gaps; vLLM bench
    serve's --request-rate) or concurrency (at most `concurrency` in flight, the next sent as one
    finishes; vLLM bench serve's --max-concurrency)."""

    mode: str = "batch"
    rate: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "poisson" and not (self.rate is not None and 0 < self.rate < math.inf):
            raise ValueError("--mode poisson needs --rate, requests per second > 0")
        if self.mode == "concurrency" and not (self.concurrency and self.concurrency >= 1):
            raise ValueError("--mode concurrency needs --concurrency >= 1")

    def describe(self) -> str:
        if self.mode == "poisson":
            return f"Poisson arrivals at {self.rate:g} requests/s (seed {self.seed})"
        if self.mode == "concurrency":
            return f"at most {self.concurrency} requests in flight"
        if self.mode == "trace":
            return "arrivals at the trace's timestamps"
        return "every request sent at once (batch)"

    def split(self, replicas: int) -> Load:
        """One of `replicas` equal shares of this load (each gets every n-th request)."""
        if self.mode == "poisson":
            return replace(self, rate=self.rate / replicas)
        if self.mode == "concurrency":
            return replace(self, concurrency=max(1, math.ceil(self.concurrency / replicas)))
        return self


@dataclass(frozen=True, slots=True)
class Speculation:
    """Speculative decoding as the engine runs it: after each sampling step a decoding request
    proposes up to `num_tokens` drafts (n-gram lookup finds a match on `proposal_rate` of its
    steps), verified in its next step as 1 + k tokens; each draft is accepted with one
    probability, given the earlier ones were, chosen so that the accepted share of proposed
    drafts is `acceptance_rate` (vLLM's spec-decode acceptance rate, as a recorded run's
    /metrics give it). Seeded: the same run draws the same acceptances."""

    num_tokens: int
    acceptance_rate: float
    proposal_rate: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError("speculation needs at least 1 draft token")
        if not 0 <= self.acceptance_rate < 1:
            raise ValueError(f"acceptance rate must be in [0, 1), not {self.acceptance_rate:g}")
        if not 0 < self.proposal_rate <= 1:
            raise ValueError(f"proposal rate must be in (0, 1], not {self.proposal_rate:g}")

    @property
    def per_draft(self) -> float:
        """The per-position acceptance q with (q + q^2 + ... + q^k) / k = acceptance_rate."""
        k, target = self.num_tokens, self.acceptance_rate
        low, high = 0.0, 1.0
        for _ in range(60):
            q = (low + high) / 2
            if sum(q**j for j in range(1, k + 1)) / k < target:
                low = q
            else:
                high = q
        return (low + high) / 2


@dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        assert self.finish_s is not None
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_length < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_length - 1)


@dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    makespan_s: float  # first arrival to last completion
    steps: int
    preemptions: int
    kv_usage: list[tuple[float, float]] = field(default_factory=list)  # (clock, used fraction)
    schedule: list[list[tuple[str, int]]] = field(default_factory=list)  # per step, if kept

    @property
    def output_tokens(self) -> int:
        return sum(r.output_length for r in self.requests)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else math.inf


def prompt_token_ids(record: TraceRecord, vocab: int = 32000, *, owner: int) -> list[int]:
    """Token ids for a trace record: block i of the prompt (the record's hash block size in
    tokens: its block_size, else Mooncake's 512; not the engine's KV block size) is a fixed
    function of hash_ids[i], so records sharing leading hash_ids share a token prefix (and its KV
    blocks). Tokens past the record's hash_ids, all of them for a record without any (unknown
    sharing), are its own: a function of `owner` (the record's index), so they share nothing with
    any other record."""
    size = record.hash_block_size
    positions = np.arange(record.input_length, dtype=np.uint64)
    # Per token: the value its block's seed mixes with its offset in the block (shared blocks)
    # or its position (the record's own tokens). Vectorised: prompts of a million tokens.
    seeds = np.full(record.input_length, _mix(_OWN_SALT, owner) & _MASK, dtype=np.uint64)
    inputs = positions.copy()
    shared = min(len(record.hash_ids) * size, record.input_length)
    if shared:
        block_seeds = np.array(
            [_mix(_SHARED_SALT, h) for h in record.hash_ids[: math.ceil(shared / size)]],
            dtype=np.uint64,
        )
        seeds[:shared] = np.repeat(block_seeds, size)[:shared]
        inputs[:shared] = positions[:shared] % np.uint64(size)
    values = _mix_array(seeds, inputs)
    return (2 + values % np.uint64(vocab - 2)).astype(np.int64).tolist()


_SHARED_SALT, _OWN_SALT = 0x5EED_0001, 0x5EED_0002
_MASK = (1 << 64) - 1


def _mix(a: int, b: int) -> int:
    """splitmix64 of a combined with b: distinct inputs give unrelated 64-bit outputs (a plain
    linear formula made blocks of different records equal modulo a small vocabulary)."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E5C3) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix_array(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """_mix over uint64 arrays (numpy's uint64 arithmetic wraps modulo 2**64, as the mask does)."""
    with np.errstate(over="ignore"):
        z = a * np.uint64(0x9E3779B97F4A7C15) + b + np.uint64(0x632BE59BD9B4E5C3)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def simulate(
    trace: list[TraceRecord],
    step_time: Callable[[StepShape], float],
    engine: EngineShape,
    *,
    time_scale: float = 1.0,
    batch: bool = False,
    keep_schedule: bool = False,
    vocab: int = 32000,
    load: Load | None = None,
    speculation: Speculation | None = None,
    request_cost_s: float = 0.0,
) -> SimResult:
    """Run the trace to completion. Arrivals as `load` says; without one, at timestamp /
    time_scale, or all at 0 (batch). With `speculation`, decoding requests verify drafts.
    `request_cost_s`: the serving front end's serial cost per request (see `_FrontEnd`)."""
    load = load or Load("batch" if batch else "trace")
    kv = KVCacheManager(engine.num_blocks, engine.block_size, engine.enable_prefix_caching)
    config = SchedulerConfig(
        engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len
    )
    scheduler = Scheduler(config, kv)
    sims, pending = _requests(trace, engine, _arrivals(trace, load, time_scale), vocab)
    by_id = {s.request_id: s for s in sims}
    closed_loop = load.mode == "concurrency"
    front = _FrontEnd(request_cost_s)
    in_flight = 0
    clock, steps, result = 0.0, 0, SimResult(sims, 0.0, 0, 0)
    rng = random.Random(speculation.seed) if speculation else None
    q = speculation.per_draft if speculation else 0.0
    while pending or front.queue or scheduler.has_unfinished():
        if closed_loop:
            # The next request goes out as soon as one of the `concurrency` finishes.
            while pending and in_flight < load.concurrency:
                request = pending.pop()[1]
                request.arrival_time = by_id[request.request_id].arrival_s = clock
                front.send(clock, request)
                in_flight += 1
        while not closed_loop and pending and pending[-1][0] <= clock:
            front.send(*pending.pop())
        for request in front.ready(clock):
            scheduler.add_request(request)
        if not scheduler.has_unfinished():
            # idle until the next arrival, or until the front end hands the next request over
            # (closed loop: pending requests are sent when others finish, not at a time)
            arrival = pending[-1][0] if pending and not closed_loop else None
            clock = min(t for t in (front.next_ready(), arrival) if t is not None)
            continue
        out = scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("the scheduler could not run anything: a request does not fit")
        clock += step_time(_shape(out))
        steps += 1
        if keep_schedule:
            result.schedule.append([(s.request.request_id, s.num_tokens) for s in out.scheduled])
        sampled = {
            s.request.request_id: [_TOKEN] * (1 + _accepted(len(s.spec_token_ids), q, rng))
            for s in out.scheduled
            if s.samples
        }
        for rid in sampled:
            if by_id[rid].first_token_s is None:
                by_id[rid].first_token_s = clock
        for request in scheduler.update(out, sampled):
            by_id[request.request_id].finish_s = clock
            in_flight -= 1
        if speculation is not None:
            _propose(out, speculation, engine.max_model_len, rng)
        result.kv_usage.append((clock, kv.usage()))
    first = min((s.arrival_s for s in sims), default=0.0)
    result.makespan_s, result.steps = clock - first, steps
    result.preemptions = scheduler.num_preemptions
    return result


class _FrontEnd:
    """The serving path before the scheduler: an HTTP request is parsed, its chat template
    applied and its prompt tokenized (and the benchmark client spends its own time on it) one
    request after another, in a process beside the engine's (vLLM's API server), so a request
    reaches the scheduler `cost` seconds after the front end is free for it. It bounds the
    request rate of short requests (GPUStack's 1000 prompts of 128 tokens on an H100 ran at 44
    requests/s); with cost 0 a request reaches the scheduler when it is sent."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.free_at = 0.0
        self.queue: deque[tuple[float, Request]] = deque()  # (ready time, request), in order

    def send(self, clock: float, request: Request) -> None:
        if self.cost <= 0:
            self.queue.append((clock, request))
            return
        self.free_at = max(self.free_at, clock) + self.cost
        self.queue.append((self.free_at, request))

    def ready(self, clock: float) -> list[Request]:
        ready = []
        while self.queue and self.queue[0][0] <= clock:
            ready.append(self.queue.popleft()[1])
        return ready

    def next_ready(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def _accepted(drafts: int, q: float, rng: random.Random | None) -> int:
    """How many of a verification's drafts are accepted: each with probability q, until the
    first rejection."""
    accepted = 0
    while accepted < drafts and rng is not None and rng.random() < q:
        accepted += 1
    return accepted


def _propose(
    out: SchedulerOutput, speculation: Speculation, max_model_len: int, rng: random.Random
) -> None:
    """Drafts for the next step, as EngineCore._propose makes them: for requests that just
    sampled and keep decoding, never past max_tokens or max_model_len."""
    for s in out.scheduled:
        r = s.request
        if not s.samples or r.status != RequestStatus.RUNNING:
            continue
        if rng.random() >= speculation.proposal_rate:
            continue
        k = min(
            speculation.num_tokens,
            r.max_tokens - len(r.output_token_ids) - 1,
            max_model_len - r.num_tokens - 1,
        )
        r.spec_token_ids = [_TOKEN] * max(0, k)


def _arrivals(trace: list[TraceRecord], load: Load, time_scale: float) -> list[float]:
    """Each record's arrival in seconds (concurrency: replaced as the run releases them)."""
    if load.mode == "trace":
        start = min((r.timestamp for r in trace), default=0.0)
        return [(r.timestamp - start) / 1000.0 / time_scale for r in trace]
    if load.mode == "poisson":
        rng, clock, arrivals = random.Random(load.seed), 0.0, []
        for _ in trace:
            arrivals.append(clock)
            clock += rng.expovariate(load.rate)
        return arrivals
    return [0.0] * len(trace)


def _requests(
    trace: list[TraceRecord], engine: EngineShape, arrivals: list[float], vocab: int
) -> tuple[list[SimRequest], list[tuple[float, Request]]]:
    sims, pending = [], []
    for index, record in enumerate(trace):
        # A request generates at least one token: a recorded 0 is sent as 1, as replay sends it.
        output = max(1, record.output_length)
        if record.input_length < 1:
            raise ValueError(f"trace record {index}: the input length must be >= 1")
        if record.input_length + output > engine.max_model_len:
            raise ValueError(
                f"trace record {index}: {record.input_length} + {output} tokens "
                f"exceed max_model_len {engine.max_model_len}"
            )
        arrival = arrivals[index]
        rid = str(index)
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
        request = Request(
            rid,
            prompt_token_ids(record, vocab, owner=index),
            params,
            output,
            arrival,
            arrival_seq=index,
        )
        sims.append(SimRequest(rid, arrival, record.input_length, output))
        pending.append((arrival, request))
    # Popped from the end: latest arrival first in the list; stable for equal times.
    pending.sort(key=lambda item: (-item[0], -item[1].arrival_seq))
    return sims, pending


def _shape(out: SchedulerOutput) -> StepShape:
    tokens = rows = pairs = context = 0
    for s in out.scheduled:
        start = s.request.num_computed_tokens  # before update(): the tokens already computed
        tokens += s.num_tokens
        pairs += s.attention_pairs(start)
        context += start + s.num_tokens
        rows += s.samples
    return StepShape(tokens, rows, pairs, context)
