"""`nightshift workload replay TRACE --base-url URL --model NAME -o result.json`: send a trace's
requests to an OpenAI-compatible server and measure TTFT, TPOT, ITL, E2E, throughputs and goodput.

Exit codes: 0 done (some requests may have failed: see the summary), 1 no request completed,
2 bad arguments, trace or tokenizer."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nightshift.cli_errors import fail, user_errors
from nightshift.workload_commands import workload_app

if TYPE_CHECKING:
    from workload.metrics import RequestRecord
    from workload.replay import PromptFn
    from workload.trace import RecordCheck, TraceRecord

log = logging.getLogger("nightshift")


class ModeChoice(StrEnum):
    batch = "batch"
    trace = "trace"
    poisson = "poisson"
    concurrency = "concurrency"


class PromptModeChoice(StrEnum):
    tokens = "tokens"
    text = "text"


# The longest prompt replayed unless told: a prompt is built in memory (ids, then JSON) before
# it is sent, so a corrupt input_length must not size it. 2^20 tokens is past every common
# model's context (Mooncake's longest is 191k).
MAX_INPUT_LENGTH = 1 << 20


@workload_app.command("replay")
def replay_command(
    trace: Annotated[Path, typer.Argument(help="Trace JSONL (workload/trace.py's format).")],
    base_url: Annotated[
        str, typer.Option(help="OpenAI-compatible base URL, like http://127.0.0.1:8000/v1.")
    ],
    model: Annotated[str, typer.Option(help="Model name the server serves.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Write the result JSON here.")],
    mode: Annotated[ModeChoice, typer.Option(help="Arrival schedule.")] = ModeChoice.batch,
    rate: Annotated[
        float | None, typer.Option(help="poisson: requests per second (default: all at once).")
    ] = None,
    burstiness: Annotated[
        float, typer.Option(help="poisson: gamma shape; 1 is Poisson, <1 burstier.")
    ] = 1.0,
    concurrency: Annotated[
        int | None,
        typer.Option(help="Most requests in flight (required by --mode concurrency)."),
    ] = None,
    time_scale: Annotated[
        float, typer.Option(help="trace: divide recorded times by this (2 = twice as fast).")
    ] = 1.0,
    max_requests: Annotated[int | None, typer.Option(help="Replay only the first N.")] = None,
    max_duration: Annotated[
        float | None, typer.Option(help="Stop sending after this many seconds.")
    ] = None,
    grace: Annotated[
        float, typer.Option(help="Seconds in-flight requests get after --max-duration.")
    ] = 30.0,
    request_timeout: Annotated[
        float,
        typer.Option(help="A request fails as a timeout after this many seconds (queue included)."),
    ] = 3600.0,
    slo: Annotated[
        str | None, typer.Option(help="Goodput SLOs in ms, e.g. ttft:500,tpot:50,e2e:20000.")
    ] = None,
    api_key_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the API key.")
    ] = None,
    prompt_mode: Annotated[
        PromptModeChoice,
        typer.Option(help="tokens: token-id prompts; text: strings (needs --tokenizer)."),
    ] = PromptModeChoice.tokens,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Local HF tokenizer folder of the served model (vocab / text)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Prompt tokens and poisson arrivals.")] = 0,
    block_size: Annotated[
        int | None,
        typer.Option(
            help="Tokens per hash_id block, overriding the trace's block_size (default: the "
            "trace's; 512 where it has none)."
        ),
    ] = None,
    plots: Annotated[Path | None, typer.Option(help="Write PNG plots into this folder.")] = None,
    max_input_length: Annotated[
        int, typer.Option(help="Refuse a trace with a longer prompt (before sending anything).")
    ] = MAX_INPUT_LENGTH,
) -> None:
    """Replay a trace against a server: exact prompt and output lengths, streamed and timed."""
    from workload.metrics import parse_slo
    from workload.output_file import BadOutputPath, check_file, check_folder
    from workload.replay import ReplayConfig, replay
    from workload.trace import block_size_option_problem, read_trace

    with user_errors(BadOutputPath):  # before a request is sent, not after the replay
        check_file(output, "-o")
        if plots is not None:
            check_folder(plots, "--plots")
    if problem := block_size_option_problem(block_size):
        raise fail(problem)
    if max_input_length < 1:
        raise fail("--max-input-length must be at least 1")
    try:
        slo_ms = parse_slo(slo) if slo else None
    except ValueError as exc:
        raise fail(str(exc)) from None
    with user_errors():
        records = read_trace(trace, _record_check(max_input_length), block_size)
    if not records:
        raise fail(f"{trace}: no records")
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise fail(f"the environment variable {api_key_env} is not set")
    config = ReplayConfig(
        base_url=base_url,
        model=model,
        mode=mode.value,
        rate=rate if rate is not None else math.inf,
        burstiness=burstiness,
        concurrency=concurrency,
        time_scale=time_scale,
        max_requests=max_requests,
        max_duration_s=max_duration,
        grace_s=grace,
        request_timeout_s=request_timeout,
        slo_ms=slo_ms,
        api_key=api_key,
        seed=seed,
    )
    try:
        config.check()
        prompt_fn = _prompt_fn(prompt_mode.value, tokenizer, seed)
    except ValueError as exc:
        raise fail(str(exc)) from None
    total = min(len(records), max_requests) if max_requests is not None else len(records)
    extra = {
        "trace": str(trace),
        "prompt_mode": prompt_mode.value,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "block_size": records[0].hash_block_size,  # the trace's, or --block-size
        "max_input_length": max_input_length,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with _Progress(total) as on_done:
        result = replay(records, config, prompt_fn, on_done, extra_config=extra)
    try:
        output.write_text(json.dumps(result, indent=1) + "\n")
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    if plots is not None:
        from workload.replay_plots import plot_replay

        for path in plot_replay(result, plots):
            log.info("plot: %s", path)
    typer.echo(format_summary(result))
    typer.echo(f"result: {output}")
    if result["summary"]["requests"]["completed"] == 0:
        raise typer.Exit(1)


def _record_check(max_input_length: int) -> RecordCheck:
    """What a record must satisfy to be replayed, checked as the trace is read (its block size
    already the trace's or --block-size): nothing is sent and no prompt is built for a trace with
    a bad record."""
    from workload.trace import block_size_problem

    def check(record: TraceRecord) -> str | None:
        if record.input_length > max_input_length:
            return (
                f"input_length {record.input_length} is longer than --max-input-length "
                f"{max_input_length}"
            )
        return block_size_problem(record)

    return check


def _prompt_fn(prompt_mode: str, tokenizer: Path | None, seed: int) -> PromptFn:
    """Prompts whose hash_id blocks have each record's block size."""
    from workload.prompt_tokens import DEFAULT_VOCAB, TextPrompts, TokenPrompts, load_tokenizer

    if prompt_mode == "text":
        if tokenizer is None:
            raise ValueError("--prompt-mode text needs --tokenizer PATH (the server's tokenizer)")
        return TextPrompts(load_tokenizer(tokenizer), seed).prompt
    vocab = load_tokenizer(tokenizer).vocab_size if tokenizer is not None else DEFAULT_VOCAB
    return TokenPrompts(vocab, seed).prompt


class _Progress:
    """A rich progress bar on a terminal; otherwise a log line every 10 s or 10 % of requests."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = self.failed = 0
        self.bar = None
        self.last_log = time.monotonic()
        self.last_step = 0

    def __enter__(self) -> Callable[[RequestRecord], None]:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True))  # stdout carries the result
            self.bar.start()
            self.task = self.bar.add_task("replay", total=self.total)
        return self.on_done

    def on_done(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        if self.bar is not None:
            description = f"replay ({self.failed} failed)" if self.failed else "replay"
            self.bar.update(self.task, advance=1, description=description)
            return
        step = self.done * 10 // max(1, self.total)
        now = time.monotonic()
        if step > self.last_step or now - self.last_log >= 10 or self.done == self.total:
            self.last_step, self.last_log = step, now
            log.info("%d/%d requests done, %d failed", self.done, self.total, self.failed)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def format_summary(result: dict) -> str:
    """The summary as a plain table (latencies in ms)."""
    s = result["summary"]
    req = s["requests"]
    lines = [
        f"requests: {req['completed']} completed, {req['failed']} failed, "
        f"{req['not_sent']} not sent (of {req['total']})",
        f"duration {s['duration_s']:.2f} s, makespan {s['makespan_s']:.2f} s, "
        f"peak concurrency {s['peak_concurrency']}",
        f"throughput: {_num(s['request_throughput'], ' req/s')}, "
        f"{_num(s['output_throughput'], ' output tok/s')}, "
        f"{_num(s['total_token_throughput'], ' total tok/s')}",
        f"tokens: {s['input_tokens']} input, {s['output_tokens']} output"
        + (f", {s['cached_tokens']} cached" if s["cached_tokens"] is not None else ""),
    ]
    if s["output_mismatch"]:
        lines.append(
            f"WARNING: {s['output_mismatch']} requests returned another output length than "
            "asked (the server ignored ignore_eos / min_tokens)"
        )
    if s["failures"]:
        lines.append("failures: " + ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items())))
    lines.append(f"{'ms':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'n':>8}")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = s[key]
        cells = "".join(f"{_ms(d[q]):>10}" for q in ("mean", "median", "p90", "p99"))
        lines.append(f"{label:<6}{cells}{d['count']:>8}")
    if s["goodput"]:
        g = s["goodput"]
        slo = ",".join(f"{k}:{v:g}" for k, v in g["slo_ms"].items())
        fraction = "-" if g["fraction"] is None else f"{g['fraction']:.1%}"
        lines.append(
            f"goodput ({slo} ms): {g['requests']} requests, "
            f"{_num(g['request_rate'], ' req/s')}, {fraction} of sent"
        )
    return "\n".join(lines)
