"""The engine's commands (generate, serve, bench) end a user's mistake with one line `error: ...`
and exit 2, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from tests.engine.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model("llama", tmp_path_factory.mktemp("cli")))


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["generate", "hi", "--model", "/nonexistent-nightshift-model"],
            ["/nonexistent-nightshift-model", "does not exist"],
        ),
        (["generate", "hi", "--raw", "--max-tokens", "-1", "--model", "{model}"], ["max_tokens"]),
        (["generate", "hi", "--raw", "--top-p", "1e-50", "--model", "{model}"], ["top_p"]),
        (["generate", "hi", "--temperature", "nan", "--model", "/nonexistent-x"], ["temperature"]),
        (["serve", "--model", "{model}", "--max-num-seqs", "0"], ["max_num_seqs"]),
        (["serve", "--model", "{model}", "--block-size", "3"], ["block_size"]),
        (["serve", "--model", "/nonexistent-nightshift-model"], ["does not exist"]),
        (
            ["bench", "engine", "--model", "/nonexistent-nightshift-model", "--skip-hf"],
            ["does not exist"],
        ),
        (["bench", "engine", "--num-prompts", "0"], None),  # typer's own range error
        (["serve", "--port", "99999999"], None),
    ],
)
def test_one_line_and_exit_2(model, args, words):
    result = CliRunner().invoke(app, [a.format(model=model) for a in args])
    assert result.exit_code == 2, result.output
    assert (
        "Traceback" not in result.output
        and result.exception is None
        or isinstance(result.exception, SystemExit)
    )
    if words is not None:
        lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, result.output
        for word in words:
            assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize(
    "args, words",
    [
        (["serve", "--port", "-1"], ["--port"]),
        (["serve", "--max-n", "0"], ["--max-n"]),
        (["serve", "--grace-period", "nan"], ["--grace-period"]),
        (["serve", "--bogus"], ["--bogus"]),
        (["bogus"], ["bogus"]),
    ],
)
def test_usage_mistakes_are_one_line_from_the_console_script(args, words):
    """Through the real entry point (click's usage box is replaced by the error line)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "nightshift.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for word in words:
        assert word in lines[0]


def test_a_port_in_use_fails_before_the_model_loads(model):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--model", model, "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "serving" not in result.output  # refused before the engine was built
