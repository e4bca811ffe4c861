"""`nightshift bench serve`: the same workload through the HTTP server (`nightshift serve` in its
own process, streaming, all requests concurrent, read by a lean SSE client) and through offline
LLM.generate, in one run; the ratio of their output-token throughputs is the serving overhead.

The two sides alternate `repeats` times (offline, HTTP, offline, HTTP, ...) against one engine
and one server that stay up, and the reported ratio is the median of the per-pair ratios: on a
shared 2-core machine a single pair swings by +-5%."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

from engine import LLM, EngineConfig
from engine.bench import BenchConfig, SideResult, make_workload, run_engine
from engine.cpu_threads import configure_threads
from engine.model_fetch import resolve_model
from engine.server.server_process import ServerProcess, start_server_process


@dataclass(slots=True)
class ServeBenchConfig:
    model: str = "default"
    num_prompts: int = 32
    max_batch: int = 32
    max_num_batched_tokens: int = 2048
    input_range: tuple[int, int] = (200, 700)
    output_range: tuple[int, int] = (64, 256)
    seed: int = 0
    repeats: int = 3
    threads: int | None = None  # both sides; None: engine/cpu_threads.py's default


def run_bench_serve(cfg: ServeBenchConfig, echo: Callable[[str], None] = print) -> dict:
    model_dir = str(resolve_model(cfg.model))
    # One count for both sides: the offline engine here, the server given it as --threads.
    threads = configure_threads(cfg.threads).threads
    engine_kwargs = dict(
        max_num_seqs=cfg.max_batch,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.input_range[1] + cfg.output_range[1] + 16,
        seed=cfg.seed,
    )
    # One workload per pair, drawn alike: both sides of a pair run the same requests, and no
    # run finds an earlier run's prompts in its prefix cache.
    workloads = [
        make_workload(
            BenchConfig(
                num_prompts=cfg.num_prompts,
                input_range=cfg.input_range,
                output_range=cfg.output_range,
                seed=cfg.seed + i,
            ),
            vocab_size=_vocab(model_dir),
        )
        for i in range(cfg.repeats)
    ]
    warm = make_workload(
        BenchConfig(num_prompts=2, input_range=(16, 32), output_range=(4, 4)),
        vocab_size=_vocab(model_dir),
    )
    llm = LLM(model=model_dir, num_threads=cfg.threads, **engine_kwargs)
    run_engine(llm, warm)  # first-call costs (allocator, thread pools) stay out of the timing
    server = _start_server(EngineConfig(model=model_dir, num_threads=threads, **engine_kwargs))
    pairs: list[tuple[SideResult, SideResult]] = []
    try:
        _run_http(server, warm)
        for workload in workloads:
            offline = run_engine(llm, workload)
            http = _run_http(server, workload)
            pairs.append((offline, http))
    finally:
        server.stop(grace_s=60)
    echo(
        f"{cfg.num_prompts} requests, inputs {cfg.input_range}, outputs {cfg.output_range}, "
        f"batch {cfg.max_batch}, {threads} threads each side"
    )
    ratios = [h.tokens_per_s / o.tokens_per_s for o, h in pairs]
    for i, ((offline, http), ratio) in enumerate(zip(pairs, ratios), 1):
        echo(
            f"  pair {i}: offline {offline.tokens_per_s:.1f} tok/s ({offline.wall_s:.1f} s), "
            f"HTTP streaming {http.tokens_per_s:.1f} tok/s ({http.wall_s:.1f} s, median TTFT "
            f"{http.extra['median_ttft_s']:.2f} s): {ratio:.2f}x"
        )
    ratio = statistics.median(ratios)
    echo(f"  HTTP / offline = {ratio:.2f}x (median of {len(ratios)} pairs)")
    return {
        "config": asdict(cfg),
        "threads": threads,
        "pairs": [{"offline": asdict(o), "http": asdict(h)} for o, h in pairs],
        "ratios": ratios,
        "ratio": ratio,
    }


def _start_server(config: EngineConfig) -> ServerProcess:
    return start_server_process(
        [
            "--model",
            config.model,
            "--served-model-name",
            "bench",
            "--max-num-seqs",
            str(config.max_num_seqs),
            "--max-num-batched-tokens",
            str(config.max_num_batched_tokens),
            "--max-model-len",
            str(config.max_model_len),
            "--threads",
            str(config.num_threads),
        ]
    )


def _vocab(model_dir: str) -> int:
    from pathlib import Path

    from engine.models.model_config import load_model_config

    return load_model_config(Path(model_dir)).vocab_size


def _run_http(server: ServerProcess, workload) -> SideResult:
    # The server runs as `nightshift serve` in its own process, as deployed: the client's Python
    # work (SSE parsing) must not share the server's interpreter lock.
    url = f"{server.base_url}/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def one(prompt: list[int], n: int) -> tuple[int, float]:
        # A lean SSE reader: this machine's two cores are shared with the server, so the load
        # generator parses only the usage chunk (a real client runs elsewhere).
        start = time.perf_counter()
        first = None
        tokens = 0
        body = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        async with client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - start
                if '"usage"' in line:
                    tokens = json.loads(line[len("data: ") :])["usage"]["completion_tokens"]
        return tokens, first or 0.0

    async def main() -> tuple[list[tuple[int, float]], float]:
        nonlocal client
        client = httpx.AsyncClient(timeout=3600, limits=limits)
        async with client:
            start = time.perf_counter()
            results = await asyncio.gather(
                *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens))
            )
            return results, time.perf_counter() - start

    client: httpx.AsyncClient
    results, wall = asyncio.run(main())
    tokens = sum(t for t, _ in results)
    assert tokens == sum(workload.output_lens), "the server produced a different number of tokens"
    ttfts = sorted(f for _, f in results)
    return SideResult(
        "http", wall, tokens, tokens / wall, {"median_ttft_s": ttfts[len(ttfts) // 2]}
    )
