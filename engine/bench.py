"""`nightshift bench engine`: the engine against HF transformers `generate`, side by side.

Mixed workload: prompts with lengths drawn uniformly from the input range, outputs from the output
range with ignore_eos, all submitted at once (offline throughput). The engine batches continuously;
HF runs padded static batches of the same maximum size in arrival order, each until its longest
requested output (as static batching must). Only requested output tokens count as throughput.

Rooflines: FLOPs are counted for the work the workload needs (every prompt token and every output
token but the last goes through the model once; attention over the real context; logits only for
sampled positions) and divided by this machine's measured fp32 matmul rate. At batch 1 a decode step
must read all weights once: bytes per step over the measured copy bandwidth bound the step time.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from engine.cpu_threads import configure_threads
from engine.models.linear import linear
from engine.models.model_config import ModelConfig


@dataclass(slots=True)
class BenchConfig:
    model: str = "default"
    num_prompts: int = 64
    max_batch: int = 32
    max_num_batched_tokens: int = 2048
    input_range: tuple[int, int] = (200, 700)
    output_range: tuple[int, int] = (64, 256)
    threads: int | None = None
    seed: int = 0
    skip_hf: bool = False
    skip_batch1: bool = False
    quantization: str | None = None  # the engine's weights: None (float32), int8, int4, fp8
    kv_cache_dtype: str = "auto"  # the engine's KV pool: auto (float32), fp8, int8
    json_out: str | None = None
    batch1_prompt: int = 400
    batch1_output: int = 128
    batch1_repeats: int = 3
    # > 1: the mixed workload also on this many tensor-parallel ranks, against one rank
    tensor_parallel_size: int = 1


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass(slots=True)
class SideResult:
    name: str
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    extra: dict = field(default_factory=dict)


# ---- the machine ---------------------------------------------------------------------------


def measure_matmul_rate(shapes: list[tuple[int, int, int]], repeats: int = 5) -> dict[str, float]:
    """fp32 GFLOP/s for each (m, k, n), median of repeats, with the fastest matmul kernel this
    torch has on the CPU (the one the engine uses: engine/models/linear.py)."""
    rates = {}
    for m, k, n in shapes:
        a, w = torch.randn(m, k), torch.randn(n, k)
        linear(a, w)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            linear(a, w)
            times.append(time.perf_counter() - start)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(times) / 1e9
    return rates


def measure_copy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s of a large tensor copy, counted as bytes copied per second (each byte is read once and
    written once); the working set is far larger than the caches."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def measure_read_bandwidth(num_bytes: int, threads: int, repeats: int = 7) -> float:
    """GB/s of reading `num_bytes` (a float32 sum on `threads` threads), median of `repeats`
    after one warm pass: what streaming a working set of that size costs on this machine, from
    the caches where it fits them (a decode step rereads its weights every step)."""
    data = torch.ones(max(num_bytes // 4, 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data.sum()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return data.numel() * 4 / statistics.median(times) / 1e9


# ---- counting ------------------------------------------------------------------------------


def linear_params(cfg: ModelConfig) -> int:
    """Parameters of the per-token matmuls (embedding lookup and the output projection excluded)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer


def workload_flops(cfg: ModelConfig, prompt_len: int, output_len: int) -> float:
    tokens = prompt_len + output_len - 1  # the last sampled token is never fed back
    linear = 2 * linear_params(cfg) * tokens
    # QK^T and PV: 2 * 2 * heads * head_dim per (query, key) pair; query i sees i + 1 keys.
    pairs = tokens * (tokens + 1) // 2
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
    logits = 2 * cfg.hidden_size * cfg.vocab_size * output_len
    return float(linear + attention + logits)


def decode_step_bytes(cfg: ModelConfig, context: int, itemsize: int = 4) -> int:
    """Bytes a batch-1 decode step must read: all matmul weights, the output projection, the KV."""
    weights = linear_params(cfg) + cfg.hidden_size * cfg.vocab_size
    kv = context * cfg.kv_bytes_per_token
    return (weights + kv) * itemsize


# ---- workload ------------------------------------------------------------------------------


def make_workload(cfg: BenchConfig, vocab_size: int, n: int | None = None) -> Workload:
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts if n is None else n
    # Random ids away from the special tokens at the start of the vocabulary; with ignore_eos the
    # content does not change the work.
    prompts = [
        [rng.randrange(256, vocab_size) for _ in range(rng.randint(*cfg.input_range))]
        for _ in range(n)
    ]
    outputs = [rng.randint(*cfg.output_range) for _ in range(n)]
    return Workload(prompts, outputs)


# ---- the two sides -------------------------------------------------------------------------


def run_engine(llm, workload: Workload, outputs: list | None = None) -> SideResult:
    """outputs: filled with each request's token ids (to compare two engines' outputs)."""
    from engine import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    results = llm.generate(workload.prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert tokens == sum(workload.output_lens), "engine produced a different number of tokens"
    if outputs is not None:
        outputs[:] = [r.outputs[0].token_ids for r in results]
    ttfts = [r.metrics.first_token_time - r.metrics.arrival_time for r in results]
    return SideResult(
        "engine", wall, tokens, tokens / wall, {"median_ttft_s": statistics.median(ttfts)}
    )


@torch.inference_mode()
def run_hf(model, workload: Workload, max_batch: int) -> SideResult:
    model.generation_config.eos_token_id = None  # as ignore_eos
    model.generation_config.pad_token_id = 0
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(workload.prompts), max_batch):
        prompts = workload.prompts[i : i + max_batch]
        outs = workload.output_lens[i : i + max_batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(outs)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
        )
        assert out.shape[1] == width + longest
        tokens += sum(outs)  # only the tokens each request asked for count
    wall = time.perf_counter() - start
    return SideResult("hf", wall, tokens, tokens / wall)


def _batch1_engine(llm, prompt: list[int], n: int) -> SideResult:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    result = llm.generate([prompt], params)[0]
    wall = time.perf_counter() - start
    m = result.metrics
    decode_s = m.finish_time - m.first_token_time
    return SideResult(
        "engine",
        wall,
        n,
        n / wall,
        {"decode_tokens_per_s": (n - 1) / decode_s, "ttft_s": m.first_token_time - m.arrival_time},
    )


@torch.inference_mode()
def _batch1_hf(model, prompt: list[int], n: int) -> SideResult:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
    wall = time.perf_counter() - start
    return SideResult(
        "hf",
        wall,
        n,
        n / wall,
        {"decode_tokens_per_s": (n - 1) / (wall - prefill), "ttft_s": prefill},
    )


# ---- the run -------------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, echo: Callable[[str], None] = print) -> dict:
    from engine.model_fetch import resolve_model

    # Both sides run in this process on the same count; every engine below resolves it alike.
    configure_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model(cfg.model)
    from engine.models.model_config import load_model_config

    _check_lengths(cfg, load_model_config(model_dir).max_position_embeddings)
    if cfg.tensor_parallel_size > 1:  # a split the model's heads do not allow fails first
        from engine.models.sharding import ShardPlan

        ShardPlan(load_model_config(model_dir), 0, cfg.tensor_parallel_size)
    llm = _engine(cfg, model_dir)
    mcfg = llm.engine.core.executor.model.config
    hf = None
    if not cfg.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()

    machine = _machine(mcfg, cfg)
    echo(
        f"machine: {machine['cpu']}, {machine['threads']} threads; "
        f"fp32 matmul {machine['matmul_gflops']:.1f} GFLOP/s (best of {machine['matmul_shapes']}), "
        f"copy {machine['copy_gbps']:.1f} GB/s"
    )
    report: dict = {"config": asdict(cfg), "machine": machine}

    # Warm both sides (allocator, thread pools) on a small slice of the same workload.
    warm = make_workload(cfg, mcfg.vocab_size, n=2)
    warm.output_lens = [4, 4]
    run_engine(llm, warm)
    if hf is not None:
        run_hf(hf, warm, cfg.max_batch)

    workload = make_workload(cfg, mcfg.vocab_size)
    flops = sum(
        workload_flops(mcfg, len(p), o) for p, o in zip(workload.prompts, workload.output_lens)
    )
    engine_tokens: list = []
    engine_res = run_engine(llm, workload, engine_tokens)
    mixed = {
        "engine": asdict(engine_res),
        "workload_gflop": flops / 1e9,
        "engine_gflops": flops / engine_res.wall_s / 1e9,
        "engine_flop_roofline_fraction": flops / engine_res.wall_s / 1e9 / machine["matmul_gflops"],
    }
    echo(
        f"\nmixed workload: {cfg.num_prompts} requests, inputs {cfg.input_range}, outputs "
        f"{cfg.output_range}, batch {cfg.max_batch}, {flops / 1e9:.0f} GFLOP"
    )
    echo(
        f"  engine: {engine_res.output_tokens} tokens in {engine_res.wall_s:.1f} s = "
        f"{engine_res.tokens_per_s:.1f} tok/s, {mixed['engine_gflops']:.1f} GFLOP/s = "
        f"{100 * mixed['engine_flop_roofline_fraction']:.0f}% of the fp32 matmul rate"
    )
    if hf is not None:
        hf_res = run_hf(hf, workload, cfg.max_batch)
        mixed["hf"] = asdict(hf_res)
        mixed["speedup"] = engine_res.tokens_per_s / hf_res.tokens_per_s
        echo(
            f"  hf:     {hf_res.output_tokens} tokens in {hf_res.wall_s:.1f} s = "
            f"{hf_res.tokens_per_s:.1f} tok/s"
        )
        echo(f"  engine / hf = {mixed['speedup']:.2f}x")
    report["mixed"] = mixed
    if cfg.tensor_parallel_size > 1:
        report["tensor_parallel"] = _run_tensor_parallel(
            cfg, model_dir, workload, engine_res, engine_tokens, echo
        )

    if not cfg.skip_batch1:
        report["batch1"] = _run_batch1(llm, hf, mcfg, cfg, machine, echo)
    if cfg.json_out:
        with open(cfg.json_out, "w") as f:
            json.dump(report, f, indent=2)
        echo(f"\nwrote {cfg.json_out}")
    return report


def _engine(cfg: BenchConfig, model_dir, **options):
    """The engine side as the benchmark runs it (float32 on the CPU, the workload's limits)."""
    from engine import LLM

    return LLM(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=cfg.max_batch,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=_max_model_len(cfg),
        seed=cfg.seed,
        quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype,
        num_threads=cfg.threads,
        **options,
    )


def _run_tensor_parallel(
    cfg: BenchConfig,
    model_dir,
    workload: Workload,
    one_rank: SideResult,
    one_rank_tokens: list,
    echo: Callable[[str], None],
) -> dict:
    """The same workload on cfg.tensor_parallel_size ranks (worker processes sharing this
    machine's cores), as a ratio to one rank measured in the same run."""
    llm = _engine(cfg, model_dir, tensor_parallel_size=cfg.tensor_parallel_size)
    try:
        warm = make_workload(cfg, llm.engine.core.vocab_size, n=2)
        warm.output_lens = [4, 4]
        run_engine(llm, warm)
        tokens: list = []
        result = run_engine(llm, workload, tokens)
    finally:
        llm.shutdown()
    ratio = result.tokens_per_s / one_rank.tokens_per_s
    same = sum(a == b for a, b in zip(tokens, one_rank_tokens))
    echo(
        f"  engine tp={cfg.tensor_parallel_size}: {result.output_tokens} tokens in "
        f"{result.wall_s:.1f} s = {result.tokens_per_s:.1f} tok/s; tp={cfg.tensor_parallel_size} "
        f"/ tp=1 = {ratio:.2f}x; greedy outputs identical for {same} of {len(tokens)} requests "
        f"(ranks share {torch.get_num_threads()} threads of this CPU: TP here is about "
        "correctness, not speed)"
    )
    return {
        "size": cfg.tensor_parallel_size,
        "engine": asdict(result),
        "ratio_to_one_rank": ratio,
        "identical_outputs": same,
        "requests": len(tokens),
    }


def _run_batch1(
    llm, hf, mcfg: ModelConfig, cfg: BenchConfig, machine: dict, echo: Callable[[str], None]
) -> dict:
    """Engine and HF alternate over `batch1_repeats` fresh prompts (no prefix-cache hits);
    medians are reported, so one noisy repeat does not decide the ratio."""
    rng = random.Random(cfg.seed + 1)
    n = cfg.batch1_output
    step_bytes = decode_step_bytes(mcfg, cfg.batch1_prompt + n // 2)
    if cfg.quantization not in (None, "none"):  # what the quantized layers actually read
        from engine.quant.quantize import weight_bytes

        floats = decode_step_bytes(mcfg, 0)
        step_bytes += weight_bytes(llm.engine.core.executor.model) - floats
    roofline_tps = machine["copy_gbps"] * 1e9 / step_bytes
    runs: dict[str, list[SideResult]] = {"engine": [], "hf": []}
    for _ in range(cfg.batch1_repeats):
        prompt = [rng.randrange(256, mcfg.vocab_size) for _ in range(cfg.batch1_prompt)]
        runs["engine"].append(_batch1_engine(llm, prompt, n))
        if hf is not None:
            runs["hf"].append(_batch1_hf(hf, prompt, n))
    medians = {side: _median_side(results) for side, results in runs.items() if results}
    eng = medians["engine"]
    out = {
        "repeats": cfg.batch1_repeats,
        "runs": {side: [asdict(r) for r in results] for side, results in runs.items()},
        "engine": eng,
        "step_bytes": step_bytes,
        "roofline_decode_tokens_per_s": roofline_tps,
        "engine_bandwidth_roofline_fraction": eng["decode_tokens_per_s"] / roofline_tps,
    }
    echo(
        f"\nbatch 1: {cfg.batch1_prompt}-token prompt, {n} output tokens, median of "
        f"{cfg.batch1_repeats}; a decode step reads {step_bytes / 1e6:.0f} MB -> roofline "
        f"{roofline_tps:.1f} tok/s"
    )
    echo(
        f"  engine: {eng['tokens_per_s']:.1f} tok/s overall, decode "
        f"{eng['decode_tokens_per_s']:.1f} tok/s = "
        f"{100 * out['engine_bandwidth_roofline_fraction']:.0f}% of the bandwidth roofline"
    )
    if "hf" in medians:
        ref = medians["hf"]
        out["hf"] = ref
        out["speedup"] = eng["tokens_per_s"] / ref["tokens_per_s"]
        out["decode_speedup"] = eng["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        echo(
            f"  hf:     {ref['tokens_per_s']:.1f} tok/s overall, decode "
            f"{ref['decode_tokens_per_s']:.1f} tok/s"
        )
        echo(f"  engine / hf = {out['speedup']:.2f}x overall, {out['decode_speedup']:.2f}x decode")
    return out


def _median_side(results: list[SideResult]) -> dict[str, float]:
    return {
        "tokens_per_s": statistics.median(r.tokens_per_s for r in results),
        "decode_tokens_per_s": statistics.median(r.extra["decode_tokens_per_s"] for r in results),
        "ttft_s": statistics.median(r.extra["ttft_s"] for r in results),
    }


def _check_lengths(cfg: BenchConfig, limit: int) -> None:
    """Each case within the model's context, or the option that changes it is named."""
    mixed = cfg.input_range[1] + cfg.output_range[1]
    if mixed + 16 > limit:
        raise ValueError(
            f"the mixed workload's longest request ({cfg.input_range[1]} + "
            f"{cfg.output_range[1]} tokens) does not fit the model's {limit}-token context: "
            "lower --input-max or --output-max"
        )
    batch1 = cfg.batch1_prompt + cfg.batch1_output
    if not cfg.skip_batch1 and batch1 + 16 > limit:
        raise ValueError(
            f"the batch-1 case ({cfg.batch1_prompt}-token prompt + {cfg.batch1_output} output "
            f"tokens) does not fit the model's {limit}-token context: pass --skip-batch1"
        )


def _max_model_len(cfg: BenchConfig) -> int:
    longest = cfg.input_range[1] + cfg.output_range[1]
    if not cfg.skip_batch1:
        longest = max(longest, cfg.batch1_prompt + cfg.batch1_output)
    return longest + 16


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        platform.machine(),
    )
    return f"{name} ({'AVX-512' if ' avx512f' in info else 'no AVX-512'}, {os.cpu_count()} CPUs)"


def _machine(mcfg: ModelConfig, cfg: BenchConfig) -> dict:
    # The denominator is the best of a large square matmul and the model's own largest matmul at
    # the engine's token budget, so the fraction is not flattered by a slow reference shape.
    shapes = [
        (2048, 2048, 2048),
        (cfg.max_num_batched_tokens, mcfg.hidden_size, 2 * mcfg.intermediate_size),
    ]
    rates = measure_matmul_rate(shapes)
    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matmul_gflops_by_shape": rates,
        "matmul_gflops": max(rates.values()),
        "matmul_shapes": ", ".join(rates),
        "copy_gbps": measure_copy_bandwidth(),
    }
