"""--kv-cache-dtype fp8 / int8: codes with a float32 scale per (token, KV head).

Tolerances, all against the float pool (float32 on CPU):
- a stored element: fp8 within 2^-4 of its magnitude plus half the smallest subnormal step
  (e4m3 has 3 mantissa bits), int8 within half a step (absmax / 254);
- the torch backend's attention output over a mixed batch (decodes, a verification chunk, fresh
  prompts, chunks after a cached prefix), relative L2 error: fp8 <= 5%, int8 <= 1% (random
  normal K/V, head_dim 32; measured 2.8-2.9% and 0.6%); and it equals attention over the
  dequantized pool within 1e-5 (the quantization is the only error);
- a tiny random model end to end (chunked prefill, prefix hits, preemption): teacher-forced prompt
  logprobs within a mean of 0.1 (fp8) / 0.03 (int8) nats of auto's (measured 0.051 / 0.012), and
  at each request's first greedy divergence from auto each side's token is in the other's top 5
  (the GUIDE's rule). Greedy tokens are not compared for equality: a random tiny model's top two
  logits are often closer than fp8's error;
- a draft model (the target itself) and two tensor-parallel ranks: the same greedy tokens as the
  same KV dtype without them (both are exact rearrangements of the same quantized K/V).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from capacity.memory import plan_memory
from capacity.model_specs import load_model_spec
from engine import LLM, SamplingParams
from engine.attention.kv_quant import (
    FP8_MAX,
    INT8_MAX,
    allocate_layer,
    dequantize_kv,
    kv_cache_format,
    quantize_kv,
)
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from tests.engine.tiny_models import build_tiny_model

QUANTIZED = ["fp8", "int8"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("kvq"))


# ----- quantize / dequantize ---------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_error_is_within_the_formats_step(name):
    gen = torch.Generator().manual_seed(0)
    # Rows of very different ranges (RoPE'd keys differ by head), one all zero, one outlier.
    x = torch.randn(64, 4, 32, generator=gen) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3, 1] = 0.0
    x[5, 2, 7] = 1e4
    fmt = kv_cache_format(name, torch.float32)
    codes, scales = quantize_kv(x, fmt.dtype)
    assert codes.dtype == fmt.dtype and scales.dtype == torch.float32
    assert scales.shape == x.shape[:2]
    absmax = x.abs().amax(-1)
    torch.testing.assert_close(scales, absmax / fmt.qmax)
    back = dequantize_kv(codes, scales, torch.float32)
    err = (back - x).abs()
    if name == "fp8":
        bound = x.abs() * 2**-4 + (scales * 2**-10)[..., None]
    else:
        bound = (scales / 2)[..., None] * 1.0001
    assert (err <= bound).all()
    assert back[3, 1].eq(0).all() and scales[3, 1] == 0  # a zero row reads back as zeros
    assert codes.float().abs().max() == (FP8_MAX if name == "fp8" else INT8_MAX)


def test_every_fp8_code_reads_back_exactly():
    """The CPU reads fp8 codes by moving their bits into float16 (torch's own cast is slow):
    the same values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    scales = torch.full((1,), 0.37)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_kv(codes.view(1, 256), scales, dtype)[0]
        assert torch.equal(got[finite], (codes.float() * 0.37).to(dtype)[finite])


def test_format_bytes_include_the_scales():
    auto = kv_cache_format("auto", torch.bfloat16)
    fp8 = kv_cache_format("fp8", torch.bfloat16)
    assert auto.dtype == torch.bfloat16 and not auto.quantized
    # 32 layers x 8 KV heads x head_dim 128: bf16 2 bytes an element; fp8 1 + 4 per head row.
    assert auto.bytes_per_token(32, 8, 128) == 2 * 32 * 8 * 128 * 2
    assert fp8.bytes_per_token(32, 8, 128) == 2 * 32 * 8 * (128 + 4)
    assert kv_cache_format("int8", torch.float32).bytes_per_token(1, 1, 64) == 2 * 68


# ----- the torch backend against the float pool ------------------------------------------------


def _meta(requests: list[tuple[int, int]], block_size: int, seed: int) -> AttentionMetadata:
    """Requests (cached_len, q_len) in the runner's order over shuffled block ids."""
    requests = sorted(requests, key=lambda r: (r[1] != 1, r[1], r[0]))
    needed = [-(-(c + q) // block_size) for c, q in requests]
    free = torch.randperm(sum(needed) + 2, generator=torch.Generator().manual_seed(seed)).tolist()
    slots, qsl, seq_lens, tables = [], [0], [], []
    for (cached, q_len), n in zip(requests, needed):
        table = [free.pop() for _ in range(n)]
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(cached, cached + q_len)
        ]
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(cached + q_len)
        tables.append(table)
    width = max(map(len, tables))
    return AttentionMetadata(
        num_decodes=sum(q == 1 for _, q in requests),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl,
        seq_lens_list=seq_lens,
        block_size=block_size,
    )


def _cached_slots(meta: AttentionMetadata) -> torch.Tensor:
    bs, out = meta.block_size, []
    for r, seq_len in enumerate(meta.seq_lens_list):
        q_len = meta.query_start_loc[r + 1] - meta.query_start_loc[r]
        table = meta.block_tables[r].tolist()
        out += [table[p // bs] * bs + p % bs for p in range(seq_len - q_len)]
    return torch.tensor(out, dtype=torch.int64)


# Decodes, a 5-token verification chunk, fresh prompts, chunks after a cached prefix.
REQUESTS = [(37, 1), (80, 1), (5, 1), (30, 5), (0, 23), (40, 17), (61, 9)]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_torch_backend_reads_what_it_stored(name, heads):
    num_heads, num_kv_heads, head_dim, bs = *heads, 32, 16
    meta = _meta(REQUESTS, bs, seed=1)
    num_blocks = int(meta.block_tables.max()) + 3
    gen = torch.Generator().manual_seed(2)
    cached = _cached_slots(meta)
    past_k, past_v = (torch.randn(len(cached), num_kv_heads, head_dim, generator=gen) for _ in "kv")
    num_tokens = meta.query_start_loc[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) for _ in "kv")
    backend = TorchAttentionBackend()
    pools = {}
    for kv in ("auto", name):
        pool = allocate_layer(
            kv_cache_format(kv, torch.float32), num_blocks, bs, num_kv_heads, head_dim, CPU
        )
        # Earlier steps left the cached context; this step writes its own tokens, then attends.
        backend.write_kv(
            past_k, past_v, pool.k, pool.v, replace(meta, slot_mapping=cached), pool.scales
        )
        backend.write_kv(k, v, pool.k, pool.v, meta, pool.scales)
        pools[kv] = pool
    want = backend.forward(q, pools["auto"].k, pools["auto"].v, replace(meta, cache={}), 0.17)
    quant = pools[name]
    got = backend.forward(
        q, quant.k, quant.v, replace(meta, cache={}), 0.17, kv_scales=quant.scales
    )
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= (0.05 if name == "fp8" else 0.01), rel
    # The only error is the quantization: attention over the dequantized pool is the same.
    k_deq = dequantize_kv(quant.k, quant.k_scale, torch.float32)
    v_deq = dequantize_kv(quant.v, quant.v_scale, torch.float32)
    exact = backend.forward(q, k_deq, v_deq, replace(meta, cache={}), 0.17)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)


# ----- the engine --------------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(2, 384) for _ in range(40)]
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    return prompts + [shared + [rng.randrange(2, 384) for _ in range(9)] for _ in range(4)]


# A 32-token budget chunks the prompts, 20 blocks of 16 preempt, four prompts share 40 tokens.
CRAMPED = dict(device="cpu", max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=20)


@pytest.fixture(scope="module")
def auto_run(tiny):
    return _run(tiny, "auto")


def _run(model: Path, kv: str) -> dict:
    llm = LLM(model=str(model), kv_cache_dtype=kv, **CRAMPED)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    teacher = SamplingParams(max_tokens=1, prompt_logprobs=0)
    core = llm.engine.core
    out = {
        "greedy": llm.generate(_prompts(), greedy),
        "prompt": llm.generate(_prompts(), teacher),
        "preemptions": core.scheduler.num_preemptions,
        "hits": core.kv.prefix_stats.hit_tokens,
        "pool": core.executor.runner.kv_caches[0],
    }
    core.kv.check_integrity()
    return out


@pytest.mark.parametrize("name", QUANTIZED)
def test_an_llm_with_a_quantized_kv_cache_stays_close_to_auto(tiny, auto_run, name):
    run = _run(tiny, name)
    pool = run["pool"]
    assert pool.k.dtype == kv_cache_format(name, torch.float32).dtype
    assert pool.k_scale is not None and pool.k_scale.shape == pool.k.shape[:3]
    assert auto_run["pool"].k.dtype == torch.float32 and auto_run["pool"].scales is None
    assert run["preemptions"] > 0 and run["hits"] > 0
    # Teacher-forced: the same prompts, each position's logprob of the actual next token.
    diffs = [
        abs(next(iter(a.values())) - next(iter(b.values())))
        for ra, rb in zip(auto_run["prompt"], run["prompt"])
        for a, b in zip(ra.prompt_logprobs[1:], rb.prompt_logprobs[1:])
    ]
    assert sum(diffs) / len(diffs) <= (0.1 if name == "fp8" else 0.03)
    for ra, rb in zip(auto_run["greedy"], run["greedy"]):
        a, b = ra.outputs[0], rb.outputs[0]
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is not None:
            assert b.token_ids[first] in a.logprobs[first]
            assert a.token_ids[first] in b.logprobs[first]


@pytest.mark.parametrize("name", ["auto", *QUANTIZED])
@pytest.mark.parametrize("budget", [300_000, 12_345_678])
def test_block_counts_match_the_planner(tiny, name, budget):
    """The same kv_cache_memory: the engine's pool and the planner's memory table agree."""
    from engine.engine_builder import build_engine_core

    config = EngineConfig(
        model=str(tiny), device="cpu", kv_cache_memory=budget, kv_cache_dtype=name
    )
    engine_blocks = build_engine_core(config, tiny).num_blocks
    plan = plan_memory(
        load_model_spec(tiny),
        64 << 30,
        dtype="fp32",  # the engine's dtype on CPU
        kv_dtype=None if name == "auto" else name,
        kv_cache_memory=budget,
        max_num_batched_tokens=1024,
        max_num_seqs=64,
        max_model_len=256,
        kv_token_scales=True,
    )
    assert plan.num_blocks == engine_blocks
    # 2 layers x 2 KV heads x head_dim 16: float32 64 bytes a head row, fp8/int8 16 + 4.
    per_token = {"auto": 2 * 2 * 2 * 64, "fp8": 2 * 2 * 2 * 20, "int8": 2 * 2 * 2 * 20}[name]
    assert engine_blocks == budget // (16 * per_token)


def test_a_speculating_draft_keeps_its_kv_in_the_same_format(tiny):
    """The target as its own draft: greedy output as without speculation, both pools int8."""
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(tiny), kv_cache_dtype="int8", **CRAMPED)
    spec = LLM(
        model=str(tiny),
        kv_cache_dtype="int8",
        speculative="draft",
        draft_model=str(tiny),
        num_speculative_tokens=3,
        **{**CRAMPED, "num_kv_blocks": 40},
    )
    want = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    got = [r.outputs[0].token_ids for r in spec.generate(prompts, params)]
    assert got == want
    assert spec.spec_decode_stats()["num_accepted_tokens"] > 0
    assert spec.engine.core.proposer.kv_caches[0].k.dtype == torch.int8


# ----- options, reports --------------------------------------------------------------------------


def test_a_bad_kv_cache_dtype_names_the_choices(tiny):
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, fp8, int8, not 'fp16'"
    ):
        EngineConfig(kv_cache_dtype="fp16").validate()
    from nightshift.cli import app

    result = CliRunner().invoke(
        app, ["generate", "hi", "--raw", "--model", str(tiny), "--kv-cache-dtype", "e5m2"]
    )
    assert result.exit_code == 2
    assert "kv_cache_dtype must be one of auto, fp8, int8" in result.output


def test_metrics_and_the_startup_log_name_the_kv_dtype(tiny, caplog):
    from prometheus_client import generate_latest

    from engine.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics

    caplog.set_level("INFO", logger="engine")
    engine = AsyncEngine(EngineConfig(model=str(tiny), device="cpu", kv_cache_dtype="fp8"))
    try:
        text = generate_latest(ServerMetrics(engine, "m").registry).decode()
        blocks = engine.info.num_kv_blocks
    finally:
        engine.shutdown()
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert 'cache_dtype="fp8"' in line and f'num_gpu_blocks="{blocks}"' in line
    assert "kv_cache_dtype fp8: float8_e4m3fn + float32 scale per token and KV head" in caplog.text


def test_two_tensor_parallel_ranks_quantize_their_own_heads(tiny):
    """Scales are per KV head, so splitting the heads over ranks changes nothing: two ranks give
    one rank's greedy tokens, each holding its head's codes and scales."""
    prompts = _prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = LLM(model=str(tiny), kv_cache_dtype="fp8", **CRAMPED)
    want = [r.outputs[0].token_ids for r in one.generate(prompts, params)]
    two = LLM(model=str(tiny), kv_cache_dtype="fp8", tensor_parallel_size=2, **CRAMPED)
    try:
        got = [r.outputs[0].token_ids for r in two.generate(prompts, params)]
        pool = two.engine.core.executor.runner.kv_caches[0]
        assert pool.k.dtype == torch.float8_e4m3fn and pool.k_scale.shape[2] == 1  # 2 heads / 2
    finally:
        two.shutdown()
    assert got == want
