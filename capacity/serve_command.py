"""The `nightshift serve` command line that runs a plan: the planner's tensor-parallel size,
replicas and engine settings under the engine's own flag names, so an answer is something to
run, not to translate. Where the engine cannot run the plan as simulated yet, the command says
why beside it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from capacity.planner import GpuPlan, PlanSettings

# The engine's --dtype for each weight format the planner knows; the others it cannot load yet.
_ENGINE_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass(frozen=True, slots=True)
class ServeCommand:
    args: list[str]
    caveats: list[str]

    @property
    def line(self) -> str:
        return shlex.join(self.args)


def serve_command(plan: GpuPlan, settings: PlanSettings, model_name: str) -> ServeCommand:
    memory = plan.memory
    args = ["nightshift", "serve", "--model", f"MODEL_DIR/{model_name}"]
    caveats = []
    if plan.tp > 1:
        args += ["--tensor-parallel-size", str(plan.tp)]
    if plan.replicas > 1:
        args += ["--data-parallel-size", str(plan.replicas)]
    dtype = _ENGINE_DTYPES.get(settings.dtype)
    if dtype is not None:
        args += ["--dtype", dtype]
    else:
        caveats.append(
            f"{settings.dtype} weights: the engine loads bf16, fp16 or fp32 checkpoints only"
        )
    kv = settings.kv_cache_dtype
    if kv in ("fp8", "int8"):
        args += ["--kv-cache-dtype", kv]
        caveats.append(
            f"KV cache in {kv}: the engine keeps a float32 scale per token and KV head beside "
            f"the codes (vLLM's fp8 one per layer), so its pool holds a few percent fewer blocks "
            f"than planned (4 bytes per head_dim bytes; plan_memory(kv_token_scales=True) has "
            f"its exact count)"
        )
    elif kv is not None and kv != dtype:
        caveats.append(f"KV cache in {kv}: the engine keeps K/V in the compute dtype, fp8 or int8")
    args += [
        "--block-size",
        str(settings.block_size),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--gpu-memory-utilization",
        f"{settings.utilization:g}",
    ]
    if memory is not None:
        args += ["--max-model-len", str(memory.max_model_len)]
    if settings.enforce_eager:
        args.append("--enforce-eager")
    if settings.speculation is not None:
        args += [
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            str(settings.speculation.num_tokens),
        ]
    return ServeCommand(args, caveats)
