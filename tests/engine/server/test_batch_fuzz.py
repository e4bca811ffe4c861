"""The Batch API's routes fuzzed with schemathesis from the server's own /openapi.json (as
test_fuzz.py does for the rest): valid and schema-breaking bodies, paths and query parameters.
Every answer below 500 with OpenAI's error object, none hangs, and the server stays healthy."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from engine.server.batch_config import BatchConfig
from tests.engine.server.live_server import build_chat_model, live_server
from tests.engine.server.test_fuzz import MODEL, _fuzz


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_chat_model(tmp_path_factory.mktemp("batch-fuzz"))
    batch = BatchConfig(home=tmp_path_factory.mktemp("batch-fuzz-home"))
    with live_server(model, MODEL, app_options={"batch": batch}, max_model_len=96) as running:
        yield running


def test_batch_routes_fuzzed_give_no_server_error(server):
    url, engine = server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    tally: Counter = Counter()
    failures: list[str] = []
    paths = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.path.startswith(("/v1/files", "/v1/batches")):
            continue
        paths.add(f"{operation.method.upper()} {operation.path}")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, url, tally, failures)
    assert len(paths) == 9, paths  # every Batch API route was fuzzed
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{url}/health").status_code == 200
    deadline = time.monotonic() + 30
    while engine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_unfinished == 0
