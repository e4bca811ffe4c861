"""The shipped scale-out manifests: every flag they pass is one the command takes (a renamed
option fails here, not in a cluster), the router finds the engines through the headless Service
it names, the key comes from a Secret and lets the router listen on 0.0.0.0, and the
tensor-parallel StatefulSet gives each rank the env:// rendezvous variables and a rank-0
Service."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import yaml

from engine.router.router_config import RouterConfig
from engine.router.serve_router import RouterBindError, check_router_bind
from nightshift.cli import app

KUBE = Path(__file__).resolve().parents[2] / "ops" / "kubernetes"
ENTRYPOINT = ["nightshift", "serve", "--host", "0.0.0.0", "--port", "8000"]  # the images'


def _docs(name: str) -> dict[tuple[str, str], dict]:
    return {
        (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((KUBE / name).read_text())
    }


def _options(command: str) -> set[str]:
    cli = typer.main.get_command(app)
    params = cli.commands[command].params  # type: ignore[attr-defined]
    return {o for p in params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}


def _flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _key_from_secret(container: dict) -> bool:
    env = {e["name"]: e for e in container.get("env", [])}
    return "secretKeyRef" in env.get("NIGHTSHIFT_API_KEY", {}).get("valueFrom", {})


def test_replicas_behind_the_router():
    docs = _docs("nightshift-replicas.yaml")
    engine = _container(docs["Deployment", "nightshift-engine"])
    router_doc = docs["Deployment", "nightshift-router"]
    router = _container(router_doc)
    assert set(_flags(engine["args"])) <= _options("serve")
    assert router["command"] == ["nightshift", "router"]
    assert set(_flags(router["args"])) <= _options("router")
    # The router's backends are the headless Service of the engine pods, on their port.
    host, port = _value(router["args"], "--backend-dns").split(":")
    headless = docs["Service", host]
    assert headless["spec"]["clusterIP"] == "None"
    assert (
        headless["spec"]["selector"]
        == docs["Deployment", "nightshift-engine"]["spec"]["selector"]["matchLabels"]
    )
    assert int(port) == headless["spec"]["ports"][0]["port"] == engine["ports"][0]["containerPort"]
    RouterConfig(backend_dns=[_value(router["args"], "--backend-dns")])  # a valid value
    # Clients and the digest's CronJob call the Service `nightshift`: the router's.
    front = docs["Service", "nightshift"]
    assert front["spec"]["selector"] == router_doc["spec"]["selector"]["matchLabels"]
    # The key from the Secret, in both; with it the router may listen on 0.0.0.0.
    assert _key_from_secret(engine) and _key_from_secret(router)
    check_router_bind(_value(router["args"], "--host"), "a-key", False)
    with pytest.raises(RouterBindError):
        check_router_bind(_value(router["args"], "--host"), None, False)
    assert "nvidia.com/gpu" not in str(router["resources"])
    assert router["livenessProbe"] != router["readinessProbe"]  # no engine up: not restarted
    grace = float(_value(engine["args"], "--grace-period"))
    pod = docs["Deployment", "nightshift-engine"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > grace


def test_tensor_parallel_over_two_nodes():
    docs = _docs("nightshift-tensor-parallel.yaml")
    sts = docs["StatefulSet", "nightshift-tp"]
    container = _container(sts)
    script = container["args"][0]
    serve = script[script.index("nightshift serve") :].replace("\\\n", " ").split()
    if "--tensor-parallel-size" not in _options("serve"):  # lands with tensor parallelism
        pytest.skip("nightshift serve has no --tensor-parallel-size yet")
    assert set(_flags(serve)) <= _options("serve")
    size = int(_value(serve, "--tensor-parallel-size"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["WORLD_SIZE"]) == size == sts["spec"]["replicas"]
    assert re.search(r'export RANK="\$\{HOSTNAME##\*-\}"', script)
    ranks = docs["Service", sts["spec"]["serviceName"]]
    assert ranks["spec"]["clusterIP"] == "None" and ranks["spec"]["publishNotReadyAddresses"]
    assert env["MASTER_ADDR"] == f"nightshift-tp-0.{sts['spec']['serviceName']}"
    assert int(env["MASTER_PORT"]) == ranks["spec"]["ports"][0]["port"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    front = docs["Service", "nightshift-tp"]
    assert front["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "nightshift-tp-0"
    assert _key_from_secret(container)


def test_the_images_entrypoint_is_what_the_engine_deployment_extends():
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (KUBE.parent / "docker" / name).read_text()
        assert f'ENTRYPOINT ["{ENTRYPOINT[0]}", "{ENTRYPOINT[1]}"' in text
