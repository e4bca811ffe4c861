"""The `nightshift` command. Each area registers a sub-app (`model`, later `bench`, ...) or a
top-level command (later `generate`, `serve`) on `app`; commands import their implementation
lazily so that `nightshift --help` stays fast."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from nightshift.batch_commands import batch_app
from nightshift.capacity_commands import capacity_app
from nightshift.cli_errors import fail, user_errors
from nightshift.digest_commands import db_app, digest_app
from nightshift.router_commands import router_command, serve_data_parallel_from_cli
from nightshift.workload_commands import workload_app

app = typer.Typer(name="nightshift", no_args_is_help=True, help="Self-hosted LLM inference.")

QUANTIZATION_OPTION = typer.Option(
    help="Weights: none (the checkpoint as is), int8 (per channel), int4 (groups), fp8 (e4m3); "
    "a float checkpoint is quantized at load.",
)
QUANT_GROUP_OPTION = typer.Option(help="int4: input elements per scale (32, 64 or 128).")
THREADS_HELP = (
    "torch CPU threads (default: $OMP_NUM_THREADS, else the physical cores this process may use: "
    "CPU affinity, cgroup CPU quota, one per core not per SMT thread)."
)
THREADS_OPTION = typer.Option("--threads", help=THREADS_HELP)
BENCH_THREADS_OPTION = typer.Option(
    "--threads", help="torch CPU threads for every side (same default as `serve --threads`)."
)
KV_CACHE_DTYPE_OPTION = typer.Option(
    help="KV cache: auto (the model's dtype), fp8 (e4m3) or int8, each with a float32 scale per "
    "token and KV head (about 2x the blocks of bf16, 4x of float32, in the same memory).",
)


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress.")] = False,
) -> None:
    # Progress goes to stderr, so stdout carries only a command's result (e.g. a path). Only our
    # own packages log at INFO; third-party libraries stay at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("engine", "nightshift", "digest", "workload", "capacity"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


model_app = typer.Typer(no_args_is_help=True, help="Fetch and manage model weights.")
app.add_typer(model_app, name="model")


@model_app.command("fetch")
def model_fetch(
    force: Annotated[bool, typer.Option("--force", help="Convert again even if cached.")] = False,
) -> None:
    """Fetch the default model (SmolLM2-135M-Instruct) and print its folder."""
    from engine.model_fetch import fetch_default_model

    typer.echo(fetch_default_model(force=force))


@model_app.command("quantize")
def model_quantize(
    src: Annotated[str, typer.Argument(help="'default' or a float HF model folder.")],
    dst: Annotated[Path, typer.Argument(help="New folder for the quantized model.")],
    quantization: Annotated[str, typer.Option(help="int8, int4 or fp8.")] = "int4",
    group_size: Annotated[int, QUANT_GROUP_OPTION] = 32,
    lm_head: Annotated[bool, typer.Option("--lm-head", help="Quantize the LM head too.")] = False,
) -> None:
    """Write a quantized copy of a model folder (safetensors with scales, quantization_config)."""
    from engine.model_fetch import resolve_model
    from engine.quant.quantize import quantize_checkpoint

    with user_errors(ValueError, OSError):
        if group_size not in (32, 64, 128):
            raise ValueError(f"--group-size must be 32, 64 or 128, got {group_size}")
        quantize_checkpoint(resolve_model(src), dst, quantization, group_size, lm_head)
    typer.echo(dst)


@app.command("generate")
def generate(
    prompt: Annotated[
        str, typer.Argument(help="The user message (chat) or raw prompt (--raw).")
    ] = "Give three tips for running a reliable nightly batch job.",
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, no chat template.")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Per-request seed.")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda.")] = "auto",
    quantization: Annotated[str | None, QUANTIZATION_OPTION] = None,
    quant_group_size: Annotated[int, QUANT_GROUP_OPTION] = 32,
    kv_cache_dtype: Annotated[str, KV_CACHE_DTYPE_OPTION] = "auto",
    threads: Annotated[int | None, THREADS_OPTION] = None,
) -> None:
    """Generate one answer with the engine and print it (the main job until the digest lands)."""
    import time

    from engine import LLM, SamplingParams
    from engine.cpu_threads import check_threads

    # A bad model folder, sampling value or thread count: one line and exit 2.
    with user_errors(ValueError):
        check_threads(threads)
        # The sampling values first: a bad one is refused before the model loads.
        params = SamplingParams(
            temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens
        )
        llm = LLM(
            model=model,
            dtype=dtype,
            device=device,
            quantization=quantization,
            quant_group_size=quant_group_size,
            kv_cache_dtype=kv_cache_dtype,
            num_threads=threads,
        )
        start = time.perf_counter()
        if raw:
            result = llm.generate([prompt], params)[0]
        else:
            result = llm.chat([{"role": "user", "content": prompt}], params)[0]
    elapsed = time.perf_counter() - start
    out = result.outputs[0]
    typer.echo(out.text)
    logging.getLogger("nightshift").info(
        "%d prompt + %d output tokens in %.2f s (finish: %s)",
        len(result.prompt_token_ids),
        len(out.token_ids),
        elapsed,
        out.finish_reason,
    )


@app.command("serve")
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients use (default: --model).")
    ] = None,
    host: Annotated[str, typer.Option(help="Bind address (loopback unless told).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require this bearer key on /v1/ (visible in `ps`: prefer $NIGHTSHIFT_API_KEY "
            "or --api-key-file)."
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="Read the bearer key from this file (first line).")
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated", help="Listen beyond loopback without an API key anyway."
        ),
    ] = False,
    max_waiting_requests: Annotated[
        int | None,
        typer.Option(help="Answer 429 beyond this many waiting samples (n=k counts k).", min=1),
    ] = None,
    max_logprobs: Annotated[
        int,
        typer.Option(help="Most logprobs / top_logprobs / prompt_logprobs a request gets.", min=0),
    ] = 20,
    max_n: Annotated[int, typer.Option(help="Most samples (n) per request.", min=1)] = 128,
    max_request_bytes: Annotated[
        int, typer.Option(help="Largest request body; larger ones get a 413.", min=1)
    ] = 16 << 20,
    grace_period: Annotated[
        float, typer.Option(help="Seconds in-flight requests get after SIGTERM.")
    ] = 30.0,
    allowed_origins: Annotated[
        list[str] | None, typer.Option(help="CORS: origins allowed (repeat; default: *).")
    ] = None,
    allowed_methods: Annotated[
        list[str] | None, typer.Option(help="CORS: methods allowed (repeat; default: *).")
    ] = None,
    allowed_headers: Annotated[
        list[str] | None, typer.Option(help="CORS: headers allowed (repeat; default: *).")
    ] = None,
    allow_credentials: Annotated[
        bool, typer.Option("--allow-credentials", help="CORS: allow cookies and auth headers.")
    ] = False,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help="How tool_choice auto finds calls in the text: hermes, llama3_json or mistral "
            "(default: chosen from the chat template)."
        ),
    ] = None,
    pooling_type: Annotated[
        str,
        typer.Option(help="/v1/embeddings: last (the last prompt token's state) or mean."),
    ] = "last",
    trust_request_chat_template: Annotated[
        bool,
        typer.Option(
            "--trust-request-chat-template",
            help="Run chat templates sent in requests (a hostile one can tie up the server).",
        ),
    ] = False,
    enable_batch_api: Annotated[
        bool,
        typer.Option(
            "--enable-batch-api",
            help="Serve OpenAI's Batch API (/v1/files, /v1/batches); records in "
            "--batch-database-url, file bodies under $NIGHTSHIFT_HOME/batches.",
        ),
    ] = False,
    batch_database_url: Annotated[
        str | None,
        typer.Option(
            help="Batch records (default: $NIGHTSHIFT_BATCH_DATABASE_URL, else a SQLite file in "
            "$NIGHTSHIFT_HOME/batches)."
        ),
    ] = None,
    batch_max_file_bytes: Annotated[
        int, typer.Option(help="Largest batch input file.", min=1)
    ] = 100 << 20,
    batch_max_lines: Annotated[int, typer.Option(help="Most requests in one batch.", min=1)] = (
        50_000
    ),
    batch_concurrency: Annotated[
        int, typer.Option(help="Batch lines in the engine at once (all batches).", min=1)
    ] = 4,
    batch_priority: Annotated[
        int, typer.Option(help="Scheduler priority of batch lines (interactive: 0; lower first).")
    ] = 10,
    dtype: Annotated[str, typer.Option()] = "auto",
    device: Annotated[str, typer.Option()] = "auto",
    threads: Annotated[int | None, THREADS_OPTION] = None,
    block_size: Annotated[int, typer.Option()] = 16,
    num_kv_blocks: Annotated[int | None, typer.Option()] = None,
    kv_cache_memory: Annotated[int | None, typer.Option(help="KV pool bytes.")] = None,
    max_num_seqs: Annotated[int, typer.Option()] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option()] = 1024,
    max_model_len: Annotated[int | None, typer.Option()] = None,
    enable_prefix_caching: Annotated[bool, typer.Option()] = True,
    profile_path: Annotated[
        Path | None,
        typer.Option(help="Step profiler: one JSON line per engine step (capacity calibrate)."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="GPU: fraction of device memory for weights, activations, KV.")
    ] = 0.9,
    attention_backend: Annotated[
        str,
        typer.Option(
            help="auto (cuda: triton, cpu: torch), torch, cpu (fused C kernels, opt-in), triton."
        ),
    ] = "auto",
    enforce_eager: Annotated[
        bool, typer.Option("--enforce-eager", help="GPU: no CUDA graphs for decode steps.")
    ] = False,
    speculative: Annotated[
        str | None,
        typer.Option(help="Speculative decoding: ngram (prompt lookup) or draft (--draft-model)."),
    ] = None,
    num_speculative_tokens: Annotated[
        int, typer.Option(help="Tokens proposed per decoding request and step.")
    ] = 4,
    draft_model: Annotated[
        str | None, typer.Option(help="Draft model folder (same tokenizer as --model).")
    ] = None,
    prompt_lookup_min: Annotated[int, typer.Option(help="ngram: shortest suffix matched.")] = 2,
    prompt_lookup_max: Annotated[int, typer.Option(help="ngram: longest suffix matched.")] = 4,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            "--tensor-parallel-size",
            "-tp",
            help="Split the model over this many ranks (worker processes here, or the ranks of "
            "a torchrun-style env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; "
            "rank 0 serves, the others compute).",
            min=1,
        ),
    ] = 1,
    data_parallel_size: Annotated[
        int,
        typer.Option(
            help="Engines behind a prefix-aware router on --port; engine i listens on "
            "127.0.0.1:PORT+1+i (each on its own GPUs).",
            min=1,
        ),
    ] = 1,
    quantization: Annotated[str | None, QUANTIZATION_OPTION] = None,
    quant_group_size: Annotated[int, QUANT_GROUP_OPTION] = 32,
    kv_cache_dtype: Annotated[str, KV_CACHE_DTYPE_OPTION] = "auto",
) -> None:
    """Serve the OpenAI-compatible API (chat, completions, models, health)."""
    from engine.config import EngineConfig
    from engine.cpu_threads import check_threads
    from engine.distributed.rendezvous import RankMismatchError, RendezvousError
    from engine.server.auth import resolve_api_key
    from engine.server.batch_config import BatchConfig
    from engine.server.cors import CorsConfig
    from engine.server.limits import RequestLimits
    from engine.server.serve import EngineDiedError
    from engine.server.serve import serve as run_server

    limits = RequestLimits(
        max_logprobs=max_logprobs, max_n=max_n, max_request_bytes=max_request_bytes
    )
    from digest.store.database import StoreError

    # Bad options, a bad model folder, an unsafe bind, a batch database that cannot be opened:
    # one line and exit 2, no traceback.
    with user_errors(ValueError, OSError, StoreError):
        check_threads(threads)  # before the model loads; the engine logs what it applies
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            num_threads=threads,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            profile_path=profile_path,
            gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
            draft_model=draft_model,
            prompt_lookup_min=prompt_lookup_min,
            prompt_lookup_max=prompt_lookup_max,
            tensor_parallel_size=tensor_parallel_size,
            quantization=quantization,
            quant_group_size=quant_group_size,
            kv_cache_dtype=kv_cache_dtype,
        )
        key = resolve_api_key(api_key, api_key_file)
        batch = None
        if enable_batch_api:
            batch = BatchConfig(
                database_url=batch_database_url,
                max_file_bytes=batch_max_file_bytes,
                max_lines=batch_max_lines,
                concurrency=batch_concurrency,
                priority=batch_priority,
            )
            if data_parallel_size > 1:
                raise ValueError(
                    "--enable-batch-api serves from one engine; with --data-parallel-size > 1 "
                    "run the batch API on one of the engines instead"
                )
        if data_parallel_size > 1:  # N engines and the router (engine/router/data_parallel.py)
            return serve_data_parallel_from_cli(
                ctx,
                data_parallel_size,
                host,
                port,
                key,
                allow_unauthenticated,
                grace_period,
                device,
            )
        try:
            run_server(
                config,
                host,
                port,
                served_model_name,
                key,
                max_waiting_requests,
                grace_period,
                limits,
                allow_unauthenticated,
                cors=CorsConfig(
                    allowed_origins=allowed_origins or ["*"],
                    allowed_methods=allowed_methods or ["*"],
                    allowed_headers=allowed_headers or ["*"],
                    allow_credentials=allow_credentials,
                ),
                tool_call_parser=tool_call_parser,
                pooling_type=pooling_type,
                trust_request_chat_template=trust_request_chat_template,
                batch=batch,
            )
        except (EngineDiedError, RendezvousError) as e:
            # A supervisor restarts it (exit 1); ranks started differently are a launch
            # mistake, like a bad option (exit 2).
            raise fail(str(e), code=2 if isinstance(e, RankMismatchError) else 1) from None


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (print a table, write JSON).")
app.add_typer(bench_app, name="bench")


@bench_app.command("engine")
def bench_engine(
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    num_prompts: Annotated[int, typer.Option(help="Requests in the mixed workload.", min=1)] = 64,
    max_batch: Annotated[
        int, typer.Option(help="Engine max_num_seqs = HF static batch size.", min=1)
    ] = 32,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Engine token budget per step.", min=1)
    ] = 2048,
    input_min: Annotated[int, typer.Option(min=1)] = 200,
    input_max: Annotated[int, typer.Option(min=1)] = 700,
    output_min: Annotated[int, typer.Option(min=1)] = 64,
    output_max: Annotated[int, typer.Option(min=1)] = 256,
    threads: Annotated[int | None, BENCH_THREADS_OPTION] = None,
    seed: Annotated[int, typer.Option()] = 0,
    skip_hf: Annotated[bool, typer.Option("--skip-hf", help="Engine only.")] = False,
    skip_batch1: Annotated[bool, typer.Option("--skip-batch1", help="No batch-1 case.")] = False,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            "--tensor-parallel-size",
            "-tp",
            help="Also run the mixed workload on this many ranks, as a ratio to one.",
            min=1,
        ),
    ] = 1,
    quantization: Annotated[str | None, QUANTIZATION_OPTION] = None,
    kv_cache_dtype: Annotated[str, KV_CACHE_DTYPE_OPTION] = "auto",
) -> None:
    """Engine vs HF transformers generate on a mixed workload and at batch 1, one run."""
    from engine.bench import BenchConfig, run_bench
    from engine.cpu_threads import check_threads

    config = BenchConfig(
        model=model,
        num_prompts=num_prompts,
        max_batch=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        input_range=(input_min, input_max),
        output_range=(output_min, output_max),
        threads=threads,
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        skip_hf=skip_hf,
        skip_batch1=skip_batch1,
        json_out=json_out,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    with user_errors(ValueError):  # a bad model folder or range: one line, exit 2
        check_threads(threads)
        run_bench(config, echo=typer.echo)


@bench_app.command("serve")
def bench_serve(
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    num_prompts: Annotated[int, typer.Option(min=1)] = 32,
    max_batch: Annotated[int, typer.Option(min=1)] = 32,
    input_min: Annotated[int, typer.Option(min=1)] = 200,
    input_max: Annotated[int, typer.Option(min=1)] = 700,
    output_min: Annotated[int, typer.Option(min=1)] = 64,
    output_max: Annotated[int, typer.Option(min=1)] = 256,
    repeats: Annotated[
        int, typer.Option(help="Offline / HTTP pairs; the median ratio.", min=1)
    ] = 3,
    threads: Annotated[int | None, BENCH_THREADS_OPTION] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """The same workload over HTTP streaming and offline, one run: serving overhead."""
    import json

    from engine.cpu_threads import check_threads
    from engine.server.bench import ServeBenchConfig, run_bench_serve

    cfg = ServeBenchConfig(
        model=model,
        num_prompts=num_prompts,
        max_batch=max_batch,
        input_range=(input_min, input_max),
        output_range=(output_min, output_max),
        repeats=repeats,
        threads=threads,
    )
    with user_errors(ValueError):  # a bad model folder or range: one line, exit 2
        check_threads(threads)
        report = run_bench_serve(cfg, echo=typer.echo)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)


@bench_app.command("llamacpp")
def bench_llamacpp(
    model: Annotated[
        str, typer.Option(help="Ours: 'default' or a local HF model folder.")
    ] = "default",
    gguf: Annotated[
        str | None,
        typer.Option(help="llama.cpp's GGUF (default: the one --model default comes from)."),
    ] = None,
    llama_server: Annotated[
        str | None,
        typer.Option(
            help="llama-server binary (default: $LLAMA_SERVER, else "
            "/tmp/llamacpp/bin/llama-server, as ops/build_llamacpp.sh builds it)."
        ),
    ] = None,
    papers: Annotated[
        str, typer.Option(help="Papers file (JSON/JSONL/Atom) for the summary prompts.")
    ] = "examples/papers-2026-03-sample.jsonl",
    num_prompts: Annotated[
        int, typer.Option(help="Prompts per concurrency level (papers repeat).", min=1)
    ] = 32,
    batch1_prompts: Annotated[
        int, typer.Option(help="Batch 1: the first N prompts, one at a time.", min=1)
    ] = 8,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.", min=2)] = 128,
    concurrency: Annotated[
        list[int] | None, typer.Option(help="Concurrency levels (repeat); default 8 and 32.")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            help="Threads for each server (default: the physical cores available, as `serve`).",
        ),
    ] = None,
    quantization: Annotated[
        str | None,
        typer.Option(help="Ours: `nightshift serve --quantization` (none, int8, int4, fp8)."),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Runs of both sides; medians.", min=1)] = 1,
    skip_llamacpp: Annotated[
        bool, typer.Option("--skip-llamacpp", help="Our server only.")
    ] = False,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Our server against llama.cpp's llama-server: same GGUF, prompts and threads; batch 1
    and concurrent, one server at a time, ratios ours / llama.cpp."""
    from engine.cpu_threads import check_threads
    from engine.server.llamacpp_bench import (
        LlamaCppBenchConfig,
        LlamaCppBenchError,
        run_llamacpp_bench,
    )

    cfg = LlamaCppBenchConfig(
        model=model,
        gguf=gguf,
        llama_server=llama_server,
        papers=papers,
        num_prompts=num_prompts,
        batch1_prompts=batch1_prompts,
        max_tokens=max_tokens,
        threads=threads,
        quantization=quantization,
        repeats=repeats,
        skip_llamacpp=skip_llamacpp,
        json_out=json_out,
    )
    if concurrency:
        cfg.concurrency = concurrency
    with user_errors(ValueError):  # a bad option, model folder or papers file: exit 2
        check_threads(threads)
        try:
            run_llamacpp_bench(cfg, echo=typer.echo)
        except LlamaCppBenchError as e:  # a server or a request failed: exit 1
            raise fail(str(e), code=1) from None


@bench_app.command("structured")
def bench_structured(
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    papers: Annotated[
        str, typer.Option(help="Papers file (JSON/JSONL/Atom) for the review prompts.")
    ] = "examples/papers-2026-03-sample.jsonl",
    num_papers: Annotated[int | None, typer.Option(help="First N papers; default all.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Per review; default the digest's.", min=1)] = 768,
    frequency_penalty: Annotated[float, typer.Option()] = 0.0,
    repetition_penalty: Annotated[float, typer.Option()] = 1.0,
    repeats: Annotated[int, typer.Option(help="Constrained / same-length pairs.", min=1)] = 1,
    threads: Annotated[int | None, BENCH_THREADS_OPTION] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Constrained decoding vs free on the digest's review prompts: tok/s and parse failures."""
    from digest.review_bench import StructuredBenchConfig, run_structured_bench
    from engine.cpu_threads import check_threads

    cfg = StructuredBenchConfig(
        model=model,
        papers=papers,
        num_papers=num_papers,
        max_tokens=max_tokens,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        repeats=repeats,
        threads=threads,
        json_out=json_out,
    )
    with user_errors(ValueError):  # a bad model folder or range: one line, exit 2
        check_threads(threads)
        run_structured_bench(cfg, echo=typer.echo)


@bench_app.command("digest-quality")
def bench_digest_quality(
    papers: Annotated[
        str | None,
        typer.Option(help="Papers file (JSON/JSONL/Atom); default the shared cs.CL March 2026."),
    ] = None,
    num_papers: Annotated[int, typer.Option(help="First N papers.", min=1)] = 50,
    endpoint: Annotated[str, typer.Option(help="'local' or an OpenAI-compatible URL.")] = "local",
    model: Annotated[str | None, typer.Option(help="Model name at --endpoint.")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="Env var holding the key.")] = None,
    local_model: Annotated[str, typer.Option(help="The local server's model.")] = "default",
    concurrency: Annotated[int, typer.Option(min=1)] = 4,
    threads: Annotated[int | None, BENCH_THREADS_OPTION] = None,
    work_dir: Annotated[
        str | None, typer.Option(help="Keep the store and pages here (an empty folder).")
    ] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
    measure_only: Annotated[
        bool, typer.Option(help="Count what a bench left in --work-dir; no model calls.")
    ] = False,
    common_with: Annotated[
        list[str] | None,
        typer.Option(help="With --measure-only: only papers done in this work dir too."),
    ] = None,
) -> None:
    """The digest on real papers, then how much of its output is worth reading (issue 19)."""
    from digest.quality_bench import QualityBenchConfig, run_quality_bench
    from nightshift.digest_commands import LOCAL_SPECULATION

    server_args = (*LOCAL_SPECULATION, *(("--threads", str(threads)) if threads else ()))
    cfg = QualityBenchConfig(
        papers=papers,
        num_papers=num_papers,
        endpoint=endpoint,
        model=model,
        api_key_env=api_key_env,
        local_model=local_model,
        local_server_args=server_args if endpoint == "local" else (),
        concurrency=concurrency,
        work_dir=work_dir,
        json_out=json_out,
        measure_only=measure_only,
        common_with=tuple(common_with or ()),
    )
    with user_errors(ValueError):  # no papers file, a bad one: one line, exit 2
        run_quality_bench(cfg, echo=typer.echo)


@bench_app.command("speculative")
def bench_speculative(
    model: Annotated[str, typer.Option(help="'default' or a local HF model folder.")] = "default",
    papers: Annotated[
        str, typer.Option(help="Papers file (JSON/JSONL/Atom) for the summary prompts.")
    ] = "examples/papers-2026-03-sample.jsonl",
    num_papers: Annotated[int, typer.Option(help="Prompts per run (papers repeat).", min=1)] = 8,
    max_tokens: Annotated[
        int, typer.Option(help="Per summary; default the digest's.", min=1)
    ] = 256,
    num_speculative_tokens: Annotated[int, typer.Option(help="k proposed per step.", min=1)] = 4,
    prompt_lookup_min: Annotated[int, typer.Option(min=1)] = 2,
    prompt_lookup_max: Annotated[int, typer.Option(min=1)] = 4,
    draft_model: Annotated[
        str | None, typer.Option(help="Also run a draft-model side with this model folder.")
    ] = None,
    batch: Annotated[list[int] | None, typer.Option(help="Batch sizes; default 1 and 8.")] = None,
    frequency_penalty: Annotated[
        list[float] | None, typer.Option(help="Penalties to run; default 0 and 0.5.")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Base / ngram pairs per setting.", min=1)] = 1,
    threads: Annotated[int | None, BENCH_THREADS_OPTION] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Speculative decoding (n-gram; a draft model if given) vs none on the digest's summary
    prompts: decode tok/s."""
    from digest.spec_bench import SpecBenchConfig, run_spec_bench
    from engine.cpu_threads import check_threads

    cfg = SpecBenchConfig(
        model=model,
        papers=papers,
        num_papers=num_papers,
        max_tokens=max_tokens,
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_min=prompt_lookup_min,
        prompt_lookup_max=prompt_lookup_max,
        draft_model=draft_model,
        repeats=repeats,
        threads=threads,
        json_out=json_out,
    )
    if batch:
        cfg.batch_sizes = batch
    if frequency_penalty:
        cfg.frequency_penalties = frequency_penalty
    with user_errors(ValueError):  # a bad model folder or range: one line, exit 2
        check_threads(threads)
        run_spec_bench(cfg, echo=typer.echo)


@bench_app.command("accuracy")
def bench_accuracy(
    model: Annotated[
        str,
        typer.Option(
            help="'default', a local HF model folder, or 'random' (a tiny random-weight Llama "
            "with the default model's tokenizer, built for the run)."
        ),
    ] = "default",
    papers: Annotated[
        str, typer.Option(help="Papers file (JSON/JSONL/Atom) whose abstracts are scored.")
    ] = "examples/papers-2026-03-sample.jsonl",
    num_abstracts: Annotated[int, typer.Option(help="Abstracts for perplexity.", min=1)] = 50,
    num_prompts: Annotated[
        int, typer.Option(help="Greedy prompts (abstracts' first sentences).", min=1)
    ] = 16,
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt.", min=1)] = 64,
    formats: Annotated[
        list[str] | None,
        typer.Option(
            "--format",
            help="Repeatable: none (float32, the reference, always first), int8, int4, fp8, "
            "kv:fp8, kv:int8.",
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    threads: Annotated[int | None, BENCH_THREADS_OPTION] = None,
    llama_perplexity: Annotated[
        str | None,
        typer.Option(
            help="llama.cpp's llama-perplexity; default $LLAMA_PERPLEXITY, else "
            "/tmp/llamacpp/bin/llama-perplexity if present.",
        ),
    ] = None,
    llama_gguf: Annotated[
        str | None, typer.Option(help="GGUF for llama.cpp; default the default model's own.")
    ] = None,
    llama_ctx: Annotated[int, typer.Option(help="llama-perplexity -c.", min=4)] = 512,
    json_out: Annotated[str | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Perplexity of paper abstracts and greedy agreement with float32, per weight/KV format."""
    from engine.accuracy_bench import AccuracyBenchConfig, run_accuracy_bench
    from engine.cpu_threads import check_threads

    cfg = AccuracyBenchConfig(
        model=model,
        papers=papers,
        num_abstracts=num_abstracts,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        device=device,
        threads=threads,
        llama_perplexity=llama_perplexity,
        llama_gguf=llama_gguf,
        llama_ctx=llama_ctx,
        json_out=json_out,
    )
    if formats:
        cfg.formats = formats
    with user_errors(ValueError):  # an unknown format, a bad model or papers file: exit 2
        check_threads(threads)
        run_accuracy_bench(cfg, echo=typer.echo)


app.command("router")(router_command)
app.add_typer(digest_app, name="digest")
app.add_typer(db_app, name="db")
app.add_typer(workload_app, name="workload")
app.add_typer(capacity_app, name="capacity")
app.add_typer(batch_app, name="batch")


def run() -> None:
    """The console script: the app, except that a usage mistake (an unknown option, a value out
    of range) is one line `error: ...` and exit 2, like every other mistake, rather than click's
    usage box."""
    import sys

    try:
        code = app(standalone_mode=False)
    except _usage_errors() as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as before
            typer.echo(e.format_message())
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        typer.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _usage_errors() -> tuple[type[Exception], ...]:
    """click's UsageError, and typer's own copy of it (typer 0.2x vendors click)."""
    import click

    kinds: list[type[Exception]] = [click.UsageError]
    try:
        from typer._click.exceptions import UsageError
    except ImportError:
        pass
    else:
        kinds.append(UsageError)
    return tuple(kinds)


if __name__ == "__main__":
    run()
