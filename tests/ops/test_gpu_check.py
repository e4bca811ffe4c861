"""The GPU check script runs end to end in its smoke mode (CPU, tiny shapes, Triton
interpreter), so that it is ready when a GPU is lent: every section produces rows, the kernels
agree with the torch reference, the engine agrees with HF."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "gpu_check.py"


def test_smoke_run_writes_every_section(tmp_path):
    sections = "kernels,hf,decode,prefill,speculative,quant"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--sections", sections],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert set(sections.split(",")) <= set(rows)
    assert all(row["passed"] for row in rows["kernels"]) and len(rows["kernels"]) >= 6
    assert all(row["verdict"] == "equal" for row in rows["hf"])
    assert all(row["step_ms"] > 0 for row in rows["decode"])
    assert [row["identical"] for row in rows["speculative"]] == ["2/2", "2/2"]
    assert {row["kind"] for row in rows["quant"]} >= {"bf16", "w8a16", "w4a16"}
    assert all(row["passed"] for row in rows["quant"])
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check")
