"""The engine itself on a virtual clock.

`simulate` feeds a trace to `engine.engine_core.EngineCore` - the code the engine runs, not a
model of it: its admission, scheduler, KV cache manager, stop checks, retire path and draft
proposals - over `SimulatedExecutor`, which replaces the forward pass with the performance
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
import torch

from capacity.perf import StepShape
from capacity.simulated_executor import (
    SimulatedExecutor,
    SimulatedProposer,
    SimulatedRejectionSampler,
    SimulatedSampler,
    VirtualClock,
)
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import InvalidRequestError
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from workload.trace import TraceRecord


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
    _check_trace(trace, engine)
    clock = VirtualClock()
    executor = SimulatedExecutor(step_time, engine.num_blocks, clock, keep_schedule)
    core = simulated_core(engine, executor, vocab, speculation)
    arrivals = _arrivals(trace, load, time_scale)
    sims = [
        SimRequest(str(i), arrivals[i], r.input_length, max(1, r.output_length))
        for i, r in enumerate(trace)
    ]
    # Popped from the end: latest arrival first; equal times in trace order.
    pending = sorted(range(len(trace)), key=lambda i: (-arrivals[i], -i))
    closed_loop = load.mode == "concurrency"
    front = _FrontEnd(request_cost_s)
    in_flight = 0
    result = SimResult(sims, 0.0, 0, 0)
    while pending or front.queue or core.has_unfinished():
        if closed_loop:
            # The next request goes out as soon as one of the `concurrency` finishes.
            while pending and in_flight < load.concurrency:
                index = pending.pop()
                sims[index].arrival_s = clock.now
                front.send(clock.now, index)
                in_flight += 1
        while not closed_loop and pending and arrivals[pending[-1]] <= clock.now:
            index = pending.pop()
            front.send(arrivals[index], index)
        for index in front.ready(clock.now):
            _add(core, trace[index], index, sims[index], vocab)
        if not core.has_unfinished():
            # idle until the next arrival, or until the front end hands the next request over
            # (closed loop: pending requests are sent when others finish, not at a time)
            arrival = arrivals[pending[-1]] if pending and not closed_loop else None
            clock.now = min(t for t in (front.next_ready(), arrival) if t is not None)
            continue
        before = executor.steps
        outputs = core.step()
        if executor.steps == before:
            raise RuntimeError("the scheduler could not run anything: a request does not fit")
        for out in outputs:
            sim = sims[int(out.request.request_id)]
            if out.request.error is not None:
                raise RuntimeError(f"simulated request {sim.request_id}: {out.request.error}")
            if out.num_new_tokens and sim.first_token_s is None:
                sim.first_token_s = clock.now
            if out.finished:
                sim.finish_s = clock.now
                in_flight -= 1
        result.kv_usage.append((clock.now, core.kv.usage()))
    first = min((s.arrival_s for s in sims), default=0.0)
    result.makespan_s, result.steps = clock.now - first, executor.steps
    result.preemptions = core.scheduler.num_preemptions
    result.schedule = executor.schedule
    return result


def simulated_core(
    engine: EngineShape,
    executor: SimulatedExecutor,
    vocab: int,
    speculation: Speculation | None = None,
) -> EngineCore:
    """EngineCore over the simulated executor: the engine's own admission, scheduler, stop
    checks and proposer path, with `engine`'s settings."""
    config = EngineConfig(
        block_size=engine.block_size,
        num_kv_blocks=engine.num_blocks,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        enable_prefix_caching=engine.enable_prefix_caching,
        speculative="ngram" if speculation else None,
        num_speculative_tokens=speculation.num_tokens if speculation else 4,
    )
    kv = KVCacheManager(engine.num_blocks, engine.block_size, engine.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len),
        kv,
    )
    rng = random.Random(speculation.seed if speculation else 0)
    return EngineCore(
        scheduler,
        executor,
        SimulatedSampler(),
        SimulatedProposer(speculation.proposal_rate, rng) if speculation else None,
        executor.clock,
        config=config,
        vocab_size=vocab,
        eos_token_ids=(),
        max_model_len=engine.max_model_len,
        device=torch.device("cpu"),
        rejection_sampler=SimulatedRejectionSampler(
            speculation.per_draft if speculation else 0.0, rng
        ),
    )


def _add(core: EngineCore, record: TraceRecord, index: int, sim: SimRequest, vocab: int) -> None:
    params = SamplingParams(max_tokens=sim.output_length, ignore_eos=True, temperature=0)
    try:
        core.add_request(
            sim.request_id,
            prompt_token_ids(record, vocab, owner=index),
            params,
            arrival_time=sim.arrival_s,
        )
    except InvalidRequestError as e:
        raise ValueError(f"trace record {index}: {e}") from None


def _check_trace(trace: list[TraceRecord], engine: EngineShape) -> None:
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
        self.queue: deque[tuple[float, int]] = deque()  # (ready time, trace index), in order

    def send(self, clock: float, index: int) -> None:
        if self.cost <= 0:
            self.queue.append((clock, index))
            return
        self.free_at = max(self.free_at, clock) + self.cost
        self.queue.append((self.free_at, index))

    def ready(self, clock: float) -> list[int]:
        ready = []
        while self.queue and self.queue[0][0] <= clock:
            ready.append(self.queue.popleft()[1])
        return ready

    def next_ready(self) -> float | None:
        return self.queue[0][0] if self.queue else None


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
