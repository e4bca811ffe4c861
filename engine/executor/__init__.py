"""What EngineCore needs from whatever computes its steps.

Three implementations: UniprocExecutor (the model in this process), MultiprocExecutor
(tensor-parallel ranks in worker processes) and capacity's SimulatedExecutor (the performance
model on a virtual clock). A SchedulerOutput is the whole contract: it carries each request's
tokens to compute and its block table.
"""

from __future__ import annotations

from typing import Protocol

from engine.runner import RunnerOutput
from engine.scheduler import SchedulerOutput


class Executor(Protocol):
    num_blocks: int  # KV blocks per rank's pool (the same on every rank)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step: the scheduled chunks computed, logits for the rows that sample."""

    def check_health(self) -> None:
        """Raise ExecutorFailedError when the executor can no longer compute."""

    def shutdown(self) -> None:
        """Stop whatever the executor started (worker processes); idempotent."""
