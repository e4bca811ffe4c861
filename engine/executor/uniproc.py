"""The model on one device in this process: a ModelRunner over it."""

from __future__ import annotations

from engine.models.llama import LlamaModel
from engine.runner import ModelRunner, RunnerOutput
from engine.scheduler import SchedulerOutput


class UniprocExecutor:
    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"
    ) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.runner = ModelRunner(model, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
