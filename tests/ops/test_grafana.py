"""The shipped Grafana dashboard and provisioning: every metric a panel or variable queries is on
a live server's /metrics with the served model name (so renaming a metric fails here, not on a
dashboard), every selector filters by the `model_name` variable, and the files are what a stock
Grafana container reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server.live_server import build_chat_model, live_server

OPS = Path(__file__).resolve().parents[2] / "ops"
GRAFANA = OPS / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "nightshift.json"
MODEL = "tiny-grafana"
# A metric name in PromQL: ours all have a colon (vllm:..., nightshift:...); label names,
# functions and keywords have none. Suffixes (_bucket, _sum, _count, _total) are part of it.
METRIC = re.compile(r"(?<![\w:])((?:vllm|nightshift):[A-Za-z0-9_:]+)")
FILTER = '{model_name=~"$model_name"}'


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables'."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return exprs


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> dict[str, list[dict]]:
    """Sample name -> the label sets it has, after one streamed and one plain request on a
    server that speculates (so the spec-decode series exist too)."""
    model_dir = build_chat_model(
        tmp_path_factory.mktemp("grafana") / "m", max_position_embeddings=256
    )
    options = {"speculative": "draft", "draft_model": str(model_dir), "max_model_len": 256}
    with live_server(model_dir, MODEL, **options) as (url, _):
        body = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        chat = {**body, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=60) as r:
            assert r.status_code == 200
            assert [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"
        r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "Hi"}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(f"{url}/metrics").text
    samples: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s.labels)
    return samples


def test_every_queried_metric_is_exported_with_the_model_name(scraped):
    names = {m for expr in _queries(_dashboard()) for m in METRIC.findall(expr)}
    assert len(names) > 20  # the pattern finds them (a broken one would find none)
    missing = sorted(n for n in names if n not in scraped)
    assert not missing, f"queried but not on /metrics: {missing}"
    unlabelled = sorted(
        n for n in names if not any(ls.get("model_name") == MODEL for ls in scraped[n])
    )
    assert not unlabelled, f"no series with model_name={MODEL!r}: {unlabelled}"


def test_every_selector_filters_by_the_model_variable():
    d = _dashboard()
    for p in d["panels"]:
        for t in p["targets"]:
            for m in METRIC.finditer(t["expr"]):
                assert t["expr"][m.end() :].startswith(FILTER), (p["title"], t["expr"])


def test_the_dashboard_has_the_panels_and_variables_an_operator_needs():
    d = _dashboard()
    assert d["uid"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert "model_name" in variables["model_name"]["query"]["query"]
    for p in d["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"])
    exprs = "\n".join(_queries(d))
    for q, metric in [
        (0.5, "time_to_first_token_seconds"),
        (0.95, "time_to_first_token_seconds"),
        (0.99, "time_to_first_token_seconds"),
        (0.5, "inter_token_latency_seconds"),
        (0.99, "inter_token_latency_seconds"),
        (0.99, "e2e_request_latency_seconds"),
        (0.99, "request_queue_time_seconds"),
    ]:
        assert f"histogram_quantile({q}, sum by (le, model_name) (rate(vllm:{metric}_bucket" in (
            exprs
        )
    for metric in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:request_success_total",
        "nightshift:request_aborted_total",
        "nightshift:request_failed_total",
        "nightshift:request_rejected_total",
    ):
        assert metric in exprs, metric


def test_provisioning_is_what_a_stock_grafana_reads():
    provisioning = GRAFANA / "provisioning"
    ds = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["url"] == "${PROMETHEUS_URL}"
    boards = yaml.safe_load((provisioning / "dashboards" / "nightshift.yml").read_text())
    assert boards["apiVersion"] == 1
    (provider,) = boards["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    # Kubernetes and the README mount the dashboard folder where the provider looks.
    k8s = list(yaml.safe_load_all((OPS / "kubernetes" / "grafana.yaml").read_text()))
    (deployment,) = [d for d in k8s if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {path, "/etc/grafana/provisioning/datasources"} <= mounts
    assert "PROMETHEUS_URL" in {e["name"] for e in container["env"]}
    assert f"ops/grafana/dashboards:{path}" in (GRAFANA / "README.md").read_text()
