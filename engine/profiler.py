"""Step profiler: one JSON line per engine step, the input the capacity planner calibrates from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(slots=True)
class StepRecord:
    step: int
    time: float  # wall clock at the end of the step (unix seconds)
    wall_s: float  # step duration: schedule + forward + sample + update
    batch_size: int  # requests in the forward
    num_batched_tokens: int
    prefill_tokens: int  # tokens of prompt chunks and recomputes
    decode_requests: int  # requests computing their last token (and any proposed tokens)
    context_tokens: int  # sum of context lengths attended
    num_preempted: int
    num_waiting: int
    # Query-key pairs the attention computed: a chunk of n new tokens after s computed ones
    # attends n*s + n(n+1)/2 keys (causal). Attention FLOPs are proportional to it.
    attention_pairs: int = 0
    sampled_requests: int = 0  # logit rows: through the LM head and the sampler
    draft_tokens: int = 0  # proposed tokens verified (speculative decoding)
    # Wall-clock seconds from the end of the previous step to the start of this one while work
    # was waiting: the serving loop's own cost (outputs, detokenization, the HTTP side).
    gap_s: float = 0.0


class StepProfiler:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, record: StepRecord) -> None:
        # Opened per line: nothing stays open after the engine is gone, and a reader sees each
        # step as soon as it ends (a step is tens of ms; an append costs microseconds).
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(record)) + "\n")
