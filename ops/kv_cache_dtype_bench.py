"""KV cache dtypes on the default model on this CPU: the block count at the default KV budget, and
decode steps at batch 8 for auto (float32), fp8 and int8 pools.

One model, three pools holding the same contexts (prefilled once in float32; the fp8 / int8 pools
get them quantized as write_kv stores them), decode steps interleaved pool by pool so the
machine's load hits all three alike; medians of wall time and of this thread's CPU time (with one
torch thread, a loaded machine does not inflate the CPU time with OpenMP's spinning barriers).

    .venv/bin/python ops/kv_cache_dtype_bench.py [--context 1024] [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.attention.kv_quant import quantize_kv
from engine.config import EngineConfig
from engine.engine_builder import build_engine_core
from engine.model_fetch import resolve_model
from engine.models.loader import load_model
from engine.runner import BatchChunk, allocate_kv_caches, prepare_batch

DTYPES = ("auto", "fp8", "int8")
BLOCK_SIZE, BATCH = 16, 8


def default_budget_blocks(folder) -> dict[str, int]:
    """The engine's pool at its defaults (max_num_seqs 64, the model's max_model_len, 2 GiB)."""
    return {
        kv: build_engine_core(EngineConfig(device="cpu", kv_cache_dtype=kv), folder).num_blocks
        for kv in DTYPES
    }


def decode_steps(folder, context: int, steps: int) -> dict[str, tuple[float, float]]:
    """kv dtype -> (median wall s, median thread CPU s) of one decode step at batch 8."""
    model = load_model(folder, torch.float32, torch.device("cpu"), context + steps + 16, "torch")
    per_req = -(-(context + steps + 1) // BLOCK_SIZE)
    pools = {kv: allocate_kv_caches(model, BATCH * per_req, BLOCK_SIZE, kv) for kv in DTYPES}
    tables = [list(range(r * per_req, (r + 1) * per_req)) for r in range(BATCH)]
    rng = random.Random(0)
    cpu = torch.device("cpu")
    wall: dict[str, list[float]] = {kv: [] for kv in DTYPES}
    busy: dict[str, list[float]] = {kv: [] for kv in DTYPES}
    with torch.inference_mode():
        for table in tables:
            prompt = [rng.randrange(256, 49152) for _ in range(context)]
            for start in range(0, context, 512):
                chunk = BatchChunk(start, prompt[start : start + 512], table)
                ids, pos, meta = prepare_batch([chunk], BLOCK_SIZE, cpu)
                model.forward(ids, pos, pools["auto"], meta)
        for kv in DTYPES[1:]:
            for src, dst in zip(pools["auto"], pools[kv]):
                for x, codes, scales in ((src.k, dst.k, dst.k_scale), (src.v, dst.v, dst.v_scale)):
                    c, s = quantize_kv(x, codes.dtype)
                    codes.copy_(c)
                    scales.copy_(s)
        for step in range(steps):
            for kv in DTYPES[step % 3 :] + DTYPES[: step % 3]:
                chunks = [
                    BatchChunk(context + step, [rng.randrange(256, 49152)], t) for t in tables
                ]
                ids, pos, meta = prepare_batch(chunks, BLOCK_SIZE, cpu)
                t0, c0 = time.perf_counter(), time.thread_time()
                model.compute_logits(model.forward(ids, pos, pools[kv], meta))
                wall[kv].append(time.perf_counter() - t0)
                busy[kv].append(time.thread_time() - c0)
    return {kv: (statistics.median(wall[kv]), statistics.median(busy[kv])) for kv in DTYPES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    folder = resolve_model("default")
    for kv, blocks in default_budget_blocks(folder).items():
        print(f"default KV budget: {kv:5s} {blocks} blocks")
    torch.set_num_threads(args.threads)
    result = decode_steps(folder, args.context, args.steps)
    wall0, busy0 = result["auto"]
    for kv, (wall, busy) in result.items():
        print(
            f"context {args.context}, batch {BATCH}: {kv:5s} step {wall * 1e3:6.1f} ms wall "
            f"({BATCH / wall:5.1f} tok/s, {wall0 / wall:.2f}x auto), {busy * 1e3:6.1f} ms CPU "
            f"({busy0 / busy:.2f}x auto)"
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")


if __name__ == "__main__":
    main()
