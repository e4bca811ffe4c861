"""The capacity simulation's executor: the performance model instead of a forward pass.

EngineCore runs a simulation as it runs the engine (admission, the scheduler, stop checks,
retiring, draft proposals); only what the model would compute is replaced. Each step advances a
virtual clock by `step_time(shape)`, and every sampling row yields one token: the simulation
knows each request's output length (ignore_eos up to max_tokens, as a replay forces it), so
which token comes out does not matter. With speculative decoding, how many drafts a
verification accepts is drawn at the acceptance rate a recorded run measured; proposals are
made on the share of steps n-gram lookup found a match."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from capacity.perf import StepShape
from engine.request import Request
from engine.runner import RunnerOutput
from engine.sampler import SamplingRow
from engine.scheduler import SchedulerOutput

TOKEN = 1  # what every row "samples": no stop id, and requests ignore EOS


@dataclass(slots=True)
class VirtualClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class SimulatedExecutor:
    step_time: Callable[[StepShape], float]
    num_blocks: int
    clock: VirtualClock
    keep_schedule: bool = False
    steps: int = 0
    schedule: list[list[tuple[str, int]]] = field(default_factory=list)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.clock.now += self.step_time(step_shape(sched))
        self.steps += 1
        if self.keep_schedule:
            self.schedule.append([(s.request.request_id, s.num_tokens) for s in sched.scheduled])
        sampled = [s for s in sched.scheduled if s.samples]
        # No logits: the simulated samplers decide without them (one empty row per sample).
        rows = sum(s.num_sample_rows for s in sampled)
        return RunnerOutput(
            sampled=sampled,
            logits=torch.empty((rows, 0)),
            prompt_logits={},
            num_context_tokens=sum(
                s.request.num_computed_tokens + s.num_tokens for s in sched.scheduled
            ),
        )

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def step_shape(sched: SchedulerOutput) -> StepShape:
    tokens = rows = pairs = context = 0
    for s in sched.scheduled:
        start = s.request.num_computed_tokens  # before update(): the tokens already computed
        tokens += s.num_tokens
        pairs += s.attention_pairs(start)
        context += start + s.num_tokens
        rows += s.samples
    return StepShape(tokens, rows, pairs, context)


@dataclass(frozen=True, slots=True)
class _Drawn:
    token_ids: list[int]
    logprobs: list[None]


class SimulatedSampler:
    """Every row samples TOKEN."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], grammar=None) -> _Drawn:
        return _Drawn([TOKEN] * len(rows), [None] * len(rows))


@dataclass(frozen=True, slots=True)
class _Verified:
    token_ids: list[list[int]]
    logprobs: list[list[None]]
    num_accepted: list[int]


class SimulatedRejectionSampler:
    """A verification of k drafts accepts each with probability q, until the first rejection,
    then adds one token (the target's correction, or the bonus token after all k)."""

    def __init__(self, per_draft: float, rng: random.Random) -> None:
        self.q = per_draft
        self.rng = rng

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]], grammar=None
    ) -> _Verified:
        tokens, accepted = [], []
        for draft in drafts:
            n = 0
            while n < len(draft) and self.rng.random() < self.q:
                n += 1
            tokens.append([TOKEN] * (n + 1))
            accepted.append(n)
        return _Verified(tokens, [[None] * len(t) for t in tokens], accepted)


class SimulatedProposer:
    """n-gram lookup as a rate: on `proposal_rate` of a request's steps it finds a match and
    proposes k drafts (EngineCore chose k: never past max_tokens or max_model_len)."""

    def __init__(self, proposal_rate: float, rng: random.Random) -> None:
        self.rate = proposal_rate
        self.rng = rng

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        for request, k in requests:
            request.spec_token_ids = [TOKEN] * k if self.rng.random() < self.rate else []

    def forget(self, request_id: str) -> None:
        return None
