"""The engine settings that serve a workload best on one GPU and TP size: a grid over
max_num_seqs and max_num_batched_tokens, each point a full plan (memory budget, simulated batch,
replicas for the deadline), as published setups pick their own rather than the defaults.

Best means fewest GPUs that meet the deadline, then the shortest makespan of one replica (with no
deadline: the highest throughput). A larger token budget makes prefill steps more efficient but
takes activation memory from the KV pool; more sequences batch more decodes but preempt sooner
when the pool is short: the grid finds where the two meet for this workload."""

from __future__ import annotations

from dataclasses import dataclass, replace

from capacity.calibrate import Calibration
from capacity.gpus import GpuSpec
from capacity.model_specs import ModelSpec
from capacity.planner import GpuPlan, PlanSettings, plan_gpu
from workload.trace import TraceRecord

SEQS = (32, 64, 128, 256, 512, 1024)
TOKENS = (2048, 4096, 8192, 16384)


@dataclass(slots=True)
class SearchPoint:
    max_num_seqs: int
    max_num_batched_tokens: int
    plan: GpuPlan

    @property
    def fits(self) -> bool:
        return self.plan.error is None and self.plan.sim is not None

    def key(self) -> tuple[float, float]:
        return (self.plan.gpus, self.plan.replica_makespan_s)


@dataclass(slots=True)
class SearchResult:
    points: list[SearchPoint]
    best: SearchPoint | None  # None: no point of the grid fits


def search_settings(
    spec: ModelSpec,
    trace: list[TraceRecord],
    gpu: GpuSpec,
    tp: int,
    settings: PlanSettings,
    calibration: Calibration | None = None,
    seqs: tuple[int, ...] = SEQS,
    tokens: tuple[int, ...] = TOKENS,
) -> SearchResult:
    points = []
    for n in seqs:
        for t in tokens:
            s = replace(settings, max_num_seqs=n, max_num_batched_tokens=t)
            points.append(SearchPoint(n, t, plan_gpu(spec, trace, gpu, tp, s, calibration)))
    fitting = [p for p in points if p.fits]
    return SearchResult(points, min(fitting, key=SearchPoint.key) if fitting else None)
