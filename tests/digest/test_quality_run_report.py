"""The run report carries what the public page leaves out (issue 19): the prompt version, the
papers whose summaries are unverified, and the night's cost, by tokens or by GPU-hours."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from capacity.gpus import find_gpu
from digest.prompts import PROMPT_VERSION
from digest.run_cost import Pricing, night_cost
from nightshift.cli import app
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_cli import _run_args
from tests.digest.test_pipeline import TITLES

runner = CliRunner()


def test_the_cost_by_tokens_and_by_gpu_hours():
    tokens = night_cost(Pricing(0.15, 0.60), 2_000_000, 500_000, 99.0)
    assert tokens.usd == pytest.approx(0.30 + 0.30)
    assert "2000000 prompt tokens at $0.15/M" in tokens.basis
    h100 = find_gpu("H100")
    hosted = night_cost(Pricing(gpu="H100", gpus=2), 1, 1, 1800.0)
    assert hosted.usd == pytest.approx(1.0 * h100.price_per_hour)  # 2 GPUs x half an hour
    assert "catalogue" in hosted.basis
    own = night_cost(Pricing(gpu="H100", price_per_gpu_hour=1.5), 1, 1, 3600.0)
    assert own.usd == pytest.approx(1.5) and "(given)" in own.basis
    assert night_cost(None, 1, 1, 1.0) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(price_in_per_mtok=1.0), "both the prompt and the completion price"),
        (dict(price_in_per_mtok=1.0, price_out_per_mtok=1.0, gpu="H100"), "not both"),
        (dict(gpu="H100", price_per_gpu_hour=-1.0), "between 0 and 1e6"),
        (dict(price_per_gpu_hour=2.0), "needs the GPU"),
        (dict(gpu="H100", gpus=0), "--gpus"),
        (dict(gpu="no-such-gpu"), "no-such-gpu"),
    ],
)
def test_bad_pricing_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Pricing(**fields)


def test_digest_run_reports_cost_prompt_version_and_unverified(tmp_path, sqlite_url):
    faults = [Fault("text", text="It beats GPT-5 by 40 points.", match=TITLES[2], times=1)]
    with FaultServer(faults=faults) as stub:
        args = _run_args(tmp_path, sqlite_url, stub.base_url) + ["--price-per-mtok", "0.15,0.60"]
        result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"prompt version {PROMPT_VERSION}" in result.output
    assert "unverified: 2603.00003: the summary names GPT-5, 40" in result.output
    (cost,) = [line for line in result.output.splitlines() if line.startswith("  cost: $")]
    assert "prompt tokens at $0.15/M" in cost and "completion tokens at $0.6/M" in cost
    # The public page does not say which prompt wrote it.
    page = (tmp_path / "out").glob("digest-*.html")
    assert all(PROMPT_VERSION not in p.read_text() for p in page)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--price-per-mtok", "0.15"], "--price-per-mtok must be IN,OUT"),
        (["--gpu", "no-such-gpu"], "no-such-gpu"),
        (["--gpu-price", "2.0"], "--gpu-price needs --gpu"),
        (["--gpus", "2"], "--gpus needs --gpu"),  # was accepted and ignored
        (["--price-per-mtok", "0.15,0.6", "--gpus", "2"], "--gpus needs --gpu"),
        (["--gpu", "H100", "--gpus", "0"], "--gpus must be between 1 and 1024"),
    ],
)
def test_bad_cost_options_are_one_line_and_exit_2(tmp_path, sqlite_url, extra, message):
    result = runner.invoke(app, _run_args(tmp_path, sqlite_url, "http://127.0.0.1:9") + extra)
    assert result.exit_code == 2, result.output
    assert message in result.output
