"""Fuzz the live server with schemathesis against its own /openapi.json: valid and schema-breaking
bodies for every operation, the model name pinned to the served one so that valid bodies reach the
engine. Every answer must be below 500, none may hang, every stream must end with [DONE], and
afterwards the server is healthy with nothing left in the engine.

NIGHTSHIFT_FUZZ_EXAMPLES sets the examples per operation and mode (default 25); the figures of
a long run are in docs/OPERATIONS.md."""

from __future__ import annotations

import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"
EXAMPLES = int(os.environ.get("NIGHTSHIFT_FUZZ_EXAMPLES", "25"))
TIMEOUT_S = 60.0  # a request slower than this counts as a hang


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_chat_model(tmp_path_factory.mktemp("fuzz"))
    # A short context keeps the unbounded generations (no max_tokens) short.
    with live_server(model, MODEL, max_model_len=96, max_num_seqs=16) as running:
        yield running


def test_fuzz_finds_no_server_error_and_no_hang(server):
    url, engine = server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    tally: Counter = Counter()
    failures: list[str] = []
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, url, tally, failures)
    elapsed = time.monotonic() - started
    print(
        f"\nfuzz: {tally['sent']} requests in {elapsed:.0f} s, {tally['5xx']} server errors, "
        f"{tally['hang']} hangs, {tally['4xx']} refused (4xx), {tally['2xx']} answered"
    )
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{url}/health").status_code == 200
    deadline = time.monotonic() + 10
    while engine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_unfinished == 0
    engine.engine.core.kv.check_integrity()


def _fuzz(operation, mode, url: str, tally: Counter, failures: list[str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        if isinstance(case.body, dict):
            case.body["model"] = MODEL  # pinned, so that valid bodies reach the engine
        tally["sent"] += 1
        label = f"{operation.method.upper()} {operation.path} ({mode.value}): {case.body!r:.300}"
        try:
            response = case.call(base_url=url, timeout=TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a timeout or a dropped connection
            tally["hang"] += 1
            failures.append(f"{label} -> {type(e).__name__}: {e}")
            return
        status = response.status_code
        tally[f"{status // 100}xx"] += 1
        if status >= 500:
            failures.append(f"{label} -> {status} {response.text[:300]}")
        elif status >= 400 and "error" not in response.json():
            failures.append(f"{label} -> {status} without an error object: {response.text[:300]}")
        elif (
            status == 200
            and isinstance(case.body, dict)
            and case.body.get("stream") is True
            and not response.text.rstrip().endswith("data: [DONE]")
        ):
            failures.append(f"{label} -> a stream without [DONE]: {response.text[-300:]}")

    try:
        run()
    except Unsatisfiable:  # nothing to break: a GET without parameters has no negative cases
        assert mode == GenerationMode.NEGATIVE
