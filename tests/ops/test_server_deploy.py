"""The shipped server deployments: no key in argv, no public bind without a key, and no
restart loop on a setup mistake (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.server.serve import UnsafeBindError, check_bind

OPS = Path(__file__).resolve().parents[2] / "ops"


def _entrypoint(dockerfile: Path) -> list[str]:
    line = next(ln for ln in dockerfile.read_text().splitlines() if ln.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT"))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_docker_images_refuse_a_public_bind_without_a_key(name):
    args = _entrypoint(OPS / "docker" / name)
    host = args[args.index("--host") + 1]
    allow = "--allow-unauthenticated" in args
    with pytest.raises(UnsafeBindError, match="NIGHTSHIFT_API_KEY"):
        check_bind(host, None, allow)
    check_bind(host, "a-key", allow)  # with a key it starts


def test_kubernetes_deployment_passes_the_key_from_a_secret():
    text = (OPS / "kubernetes" / "nightshift.yaml").read_text()
    assert re.search(r"name: NIGHTSHIFT_API_KEY\s+valueFrom:\s+secretKeyRef:", text)


def test_systemd_server_unit_keeps_the_key_out_of_argv_and_stops_on_exit_2():
    unit = (OPS / "systemd" / "nightshift-server.service").read_text()
    exec_start = unit[unit.index("ExecStart=") :].split("\n# ")[0]
    assert "--api-key" not in exec_start
    assert re.search(r"^RestartPreventExitStatus=.*\b2\b", unit, re.M)
