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
        (["generate", "hi", "--model", "/nonexistent-nightshift-model"], ["/nonexistent-nightshift-model", "does not exist"]),
        (["generate", "hi", "--raw", "--max-tokens", "0", "--model", "{model}"], ["max_tokens"]),
        (["generate", "hi", "--raw", "--top-p", "1e-50", "--model", "{model}"], ["top_p"]),
        (["serve", "--model", "{model}", "--max-num-seqs", "0"], ["max_num_seqs"]),
        (["serve", "--model", "{model}", "--block-size", "3"], ["block_size"]),
        (["serve", "--model", "/nonexistent-nightshift-model"], ["does not exist"]),
        (["bench", "engine", "--model", "/nonexistent-nightshift-model", "--skip-hf"], ["does not exist"]),
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
