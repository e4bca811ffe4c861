"""Prometheus metrics under vLLM's names (`vllm:*`, labels `model_name` and `engine`, vLLM's
bucket boundaries), so dashboards and alerts written for vLLM work unchanged; plus `nightshift:*`
for what vLLM has no name for (aborts by reason, failures, rejections, step time, spec-decode
ratios) and, deprecated, the `nightshift:*` names of the same quantities that existed before.

Three observation points, each where the quantity is known exactly:
- scrape time: the engine's snapshot (queues, KV usage, prefix-cache, preemption and
  spec-decode counters), published after every step;
- the engine thread, after every step (AsyncEngine.step_observers): tokens as they are made,
  time to first token, inter-token latency, tokens per step;
- the server, as a request ends (observe_finished, count_failure, aborted/rejected): finish
  reasons and the per-request histograms.

The unit of the per-request metrics is vLLM's: a sample. An n > 1 request counts as n requests
(vLLM's n child requests), each with its own times and token counts; only vllm:request_params_n
and vllm:request_max_num_generation_tokens are observed once per caller request."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.async_engine import AsyncEngine, EngineStats
from engine.errors import EngineShutdownError, RequestFailedError
from engine.outputs import CompletionOutput, RequestOutput
from engine.spec.stats import SpecDecodeStats

# vLLM's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
REQUEST_LATENCY_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's FinishReason strings we can produce ("repetition" we never detect).
FINISHED_REASONS = ("stop", "length", "abort", "error")

# The deprecated nightshift:* histograms keep the boundaries they had.
_LEGACY_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

LABELS = ["model_name", "engine"]  # vLLM's; one engine here, index 0
ENGINE_INDEX = "0"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class _EngineState:
    """The engine's counters at scrape time, from the snapshot it publishes after each step."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        yield from self._families("vllm", [self.model_name, ENGINE_INDEX], stats)
        yield from self._families("nightshift", [self.model_name], stats)  # deprecated names

    def _families(self, prefix: str, values: list[str], stats: EngineStats):
        labels = LABELS if prefix == "vllm" else LABELS[:1]

        def family(kind, name: str, doc: str, value: float):
            f = kind(f"{prefix}:{name}", doc, labels=labels)
            f.add_metric(values, value)
            return f

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(
            gauge, "num_requests_running", "Requests in model execution batches.", stats.num_running
        )
        yield family(
            gauge, "num_requests_waiting", "Requests waiting to be processed.", stats.num_waiting
        )
        yield family(
            gauge,
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        )
        yield family(
            counter,
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield family(
            counter,
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        yield family(
            counter,
            "num_preemptions",
            "Cumulative number of preemptions from the engine.",
            stats.num_preemptions,
        )
        if stats.spec_decode is not None:
            yield from _spec_decode_families(prefix, labels, values, stats.spec_decode)


def _spec_decode_families(prefix: str, labels: list[str], values: list[str], s: SpecDecodeStats):
    """vLLM's spec-decode counters; the two ratios a dashboard wants without PromQL are ours."""
    for name, doc, value in (
        ("num_drafts", "Verifications of at least one proposed token.", s.num_drafts),
        ("num_draft_tokens", "Proposed tokens verified.", s.num_draft_tokens),
        ("num_accepted_tokens", "Proposed tokens accepted.", s.num_accepted_tokens),
    ):
        f = CounterMetricFamily(f"{prefix}:spec_decode_{name}", doc, labels=labels)
        f.add_metric(values, value)
        yield f
    per_position = CounterMetricFamily(
        f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
        "Accepted proposed tokens by position in the draft (0 is the first).",
        labels=[*labels, "position"],
    )
    for position, count in enumerate(s.accepted_per_position):
        per_position.add_metric([*values, str(position)], count)
    yield per_position
    if prefix == "nightshift":
        for name, doc, value in (
            ("acceptance_rate", "Accepted over proposed tokens, since start.", s.acceptance_rate),
            (
                "mean_acceptance_length",
                "Tokens per verification (accepted + 1), since start.",
                s.mean_acceptance_length,
            ),
        ):
            f = GaugeMetricFamily(f"nightshift:spec_decode_{name}", doc, labels=labels)
            f.add_metric(values, value)
            yield f


@dataclass(slots=True)
class _Children:
    """Several counter children that count the same event."""

    children: tuple

    def inc(self, amount: float = 1) -> None:
        for child in self.children:
            child.inc(amount)


class _ModelCounter:
    """A labelled counter with this server's model name filled in, so serving code counts with
    its own labels only: `metrics.aborted.labels("client_disconnect").inc()`. `also`: children
    that count every such event too (an abort is also a finish with reason "abort")."""

    def __init__(self, counter: Counter, model_name: str, also: tuple = ()) -> None:
        self.counter, self.model_name, self.also = counter, model_name, also

    def labels(self, *values: str) -> _Children:
        return _Children((self.counter.labels(self.model_name, *values), *self.also))


@dataclass(slots=True)
class _Progress:
    """What the engine thread last saw of one sample: its tokens, when the last of them came,
    and whether its prompt is done."""

    tokens: int = 0
    last: float = 0.0
    prefilled: bool = False


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str | None = None) -> None:
        """model_name: the served name (the `model_name` label); by default the configured
        model."""
        self.engine = engine
        self.model_name = model_name = model_name or engine.info.model
        self.registry = r = CollectorRegistry()
        r.register(_EngineState(engine, model_name))
        vllm = [model_name, ENGINE_INDEX]
        ours = [model_name]

        def vllm_histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*vllm)

        def vllm_counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*vllm)

        def our_histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS[:1], buckets=buckets, registry=r).labels(*ours)

        info = engine.info
        Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            # vLLM's label names: cache_dtype is its --kv-cache-dtype (auto, fp8, ...).
            [*LABELS, "block_size", "cache_dtype", "num_gpu_blocks"],
            registry=r,
        ).labels(*vllm, str(info.block_size), info.kv_cache_dtype, str(info.num_kv_blocks)).set(1)

        # Tokens, counted on the engine thread as they are made (vLLM's semantics: an aborted
        # request's tokens count too). nightshift:* are the deprecated names.
        self.prompt_tokens = _Children(
            (
                vllm_counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
                Counter(
                    "nightshift:prompt_tokens", "Prompt tokens.", LABELS[:1], registry=r
                ).labels(*ours),
            )
        )
        self.generation_tokens = _Children(
            (
                vllm_counter("vllm:generation_tokens", "Number of generation tokens processed."),
                Counter(
                    "nightshift:generation_tokens", "Generated tokens.", LABELS[:1], registry=r
                ).labels(*ours),
            )
        )
        self.iteration_tokens = vllm_histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.ttft = vllm_histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.legacy_ttft = our_histogram(
            "nightshift:time_to_first_token_seconds",
            "Time to first token (deprecated: vllm:time_to_first_token_seconds).",
            _LEGACY_LATENCY_BUCKETS,
        )
        self.itl = vllm_histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        # vLLM <= 0.11's name for the inter-token latency, still on older dashboards.
        self.legacy_itl = vllm_histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS,
        )
        self.step = our_histogram(
            "nightshift:step_seconds", "Engine step wall time.", _STEP_BUCKETS
        )

        # Finishes, counted by the server.
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(*vllm, reason) for reason in FINISHED_REASONS}
        self.legacy_success = Counter(
            "nightshift:request_success",
            "Finished requests by reason (deprecated: vllm:request_success).",
            [*LABELS[:1], "finished_reason"],
            registry=r,
        )
        self.aborted = _ModelCounter(
            Counter(
                "nightshift:request_aborted",
                "Requests ended before they finished: client_disconnect (the client left, "
                "streaming or not) or shutdown (the grace period after SIGTERM ran out).",
                [*LABELS[:1], "reason"],
                registry=r,
            ),
            model_name,
            also=(self.success["abort"], self.legacy_success.labels(model_name, "abort")),
        )
        self.failed = Counter(
            "nightshift:request_failed",
            "Accepted requests the engine failed (each alone; the others went on).",
            LABELS[:1],
            registry=r,
        ).labels(*ours)
        self.rejected = _ModelCounter(
            Counter(
                "nightshift:request_rejected",
                "Requests refused at admission, by code (queue_full: over --max-waiting-requests).",
                [*LABELS[:1], "code"],
                registry=r,
            ),
            model_name,
        )
        # Series at 0 from the start: a rate() over them works before the first event.
        for reason in ("client_disconnect", "shutdown"):
            self.aborted.counter.labels(model_name, reason)
        self.rejected.counter.labels(model_name, "queue_full")

        # Per-request histograms, observed as requests finish.
        self.e2e = vllm_histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = vllm_histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = vllm_histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = vllm_histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = vllm_histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.tpot = vllm_histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(info.max_model_len)
        self.request_prompt_tokens = vllm_histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = vllm_histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_max_generation_tokens = vllm_histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_n = vllm_histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.legacy_e2e = our_histogram(
            "nightshift:e2e_request_latency_seconds",
            "Arrival to finish (deprecated: vllm:e2e_request_latency_seconds).",
            _LEGACY_LATENCY_BUCKETS,
        )
        self.legacy_tpot = our_histogram(
            "nightshift:time_per_output_token_seconds",
            "Mean time per output token after the first, per request "
            "(deprecated: vllm:request_time_per_output_token_seconds).",
            _STEP_BUCKETS,
        )

        # Engine-thread state: request id -> each sample's progress; only that thread touches it.
        self._progress: dict[str, list[_Progress]] = {}
        engine.step_observers.append(self.observe_step)

    # ----- the engine thread ----------------------------------------------------------------

    def observe_step(self, elapsed: float, outputs: list[RequestOutput]) -> None:
        """After each engine step: tokens made, first tokens, inter-token latencies."""
        self.step.observe(elapsed)
        if not outputs:
            return
        now = time.time()  # the clock of RequestMetrics
        step_tokens = 0
        for out in outputs:
            progress = self._progress.pop(out.request_id, None)
            if progress is None:
                progress = [_Progress() for _ in out.outputs]
            step_tokens += sum(self._advance(p, o, out, now) for p, o in zip(progress, out.outputs))
            if not out.finished:
                self._progress[out.request_id] = progress
        self.iteration_tokens.observe(step_tokens)
        self._forget_aborted()

    def _advance(self, p: _Progress, o: CompletionOutput, out: RequestOutput, now: float) -> int:
        """Counts one sample's new tokens; returns the tokens this step computed for it as vLLM
        attributes them (the whole prompt in the step of its first token: each sample is its
        own engine request, so each prefills the prompt, as each of vLLM's n children does)."""
        new = len(o.token_ids) - p.tokens
        if new > 0:
            # vLLM's convention: one interval per output after the first, however many tokens
            # it brought (several with speculative decoding).
            if p.tokens:
                self.itl.observe(now - p.last)
                self.legacy_itl.observe(now - p.last)
            p.tokens, p.last = len(o.token_ids), now
            self.generation_tokens.inc(new)
        new = max(new, 0)
        # The prompt is done when the first token comes (or when a prefill-only request ends).
        if p.prefilled or not (new or (o.finish_reason is not None and out.error is None)):
            return new
        p.prefilled = True
        prompt = len(out.prompt_token_ids)
        self.prompt_tokens.inc(prompt)
        m = o.metrics or out.metrics
        if m.first_token_time is not None:  # none for a prefill-only request: nothing sampled
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.legacy_ttft.observe(m.first_token_time - m.arrival_time)
        return prompt + new

    def _forget_aborted(self) -> None:
        """Aborted requests send no last output: drop them once more are tracked than run."""
        if len(self._progress) > self.engine.num_unfinished:
            for rid in [rid for rid in self._progress if not self.engine.is_unfinished(rid)]:
                del self._progress[rid]

    # ----- the server -----------------------------------------------------------------------
    # The unit is vLLM's: a sample. An n > 1 request is n engine requests, as vLLM's n child
    # requests are, so each finishes, fails or is aborted as one request (`samples` of them).

    def count_failure(self, e: BaseException, samples: int = 1) -> None:
        """A request that ended with an error after admission: its samples all end."""
        if isinstance(e, EngineShutdownError):
            self.aborted.labels("shutdown").inc(samples)
        elif isinstance(e, RequestFailedError):
            self.failed.inc(samples)
            self.success["error"].inc(samples)
            self.legacy_success.labels(self.model_name, "error").inc(samples)

    def observe_finished(self, final: RequestOutput) -> None:
        """A request's last output, as the server sends it: each sample observed as a request
        with its own times and token counts (vLLM's child requests); the n parameter and the
        longest sample once per caller request (vLLM's parent request)."""
        for o in final.outputs:
            self._observe_sample(final, o)
        generated = [len(o.token_ids) for o in final.outputs]
        self.request_max_generation_tokens.observe(max(generated, default=0))
        self.request_n.observe(len(final.outputs))

    def _observe_sample(self, final: RequestOutput, o: CompletionOutput) -> None:
        reason = o.finish_reason if o.finish_reason in self.success else "abort"
        self.success[reason].inc()
        self.legacy_success.labels(self.model_name, reason).inc()
        generated = len(o.token_ids)
        self.request_prompt_tokens.observe(len(final.prompt_token_ids))
        self.request_generation_tokens.observe(generated)  # 0 for a pooling request, as vLLM's
        m = o.metrics or final.metrics
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
            self.legacy_e2e.observe(m.finish_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        # As vLLM's: a request that made no token (prefill-only: embeddings, scoring) has a
        # queue time but no prefill, decode or inference phase and no time per output token.
        if m.first_token_time is None or m.finish_time is None or m.first_scheduled_time is None:
            return
        self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        self.inference.observe(m.finish_time - m.first_scheduled_time)
        decode = m.finish_time - m.first_token_time
        self.decode.observe(decode)
        if generated > 1:  # the first token is prefill's, not decode's (vLLM: none with one)
            self.tpot.observe(decode / (generated - 1))
            self.legacy_tpot.observe(decode / (generated - 1))
