"""The cost options of `digest run` tried from outside (issue 19): a negative, NaN, infinite or
unparsable price, or an unknown GPU, is one line naming the option to fix, and exit 2 before
any work."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from tests.digest.test_cli import _run_args

RANGE = "prices must be between 0 and 1e6 USD, not"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--price-per-mtok", "nan,0.6"], f"--price-per-mtok: {RANGE} nan"),
        (["--price-per-mtok", "-1,0.6"], f"--price-per-mtok: {RANGE} -1.0"),
        (["--price-per-mtok", "0.15,1e400"], f"--price-per-mtok: {RANGE} inf"),
        (["--price-per-mtok", "cheap"], "--price-per-mtok must be IN,OUT"),
        (["--gpu", "L4", "--gpu-price", "nan"], f"--gpu-price: {RANGE} nan"),
        (["--gpu", "L4", "--gpu-price", "-3"], f"--gpu-price: {RANGE} -3.0"),
        (["--gpu", "no-such-gpu"], "--gpu: unknown GPU 'no-such-gpu'; known: "),
        (["--gpu", "L4", "--price-per-mtok", "1,2"], "--price-per-mtok and --gpu: "),
    ],
)
def test_a_bad_price_names_its_option_and_exits_2(tmp_path, sqlite_url, extra, message):
    result = CliRunner().invoke(app, _run_args(tmp_path, sqlite_url, "http://127.0.0.1:9") + extra)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {message}") and result.output.count("\n") == 1
    assert not (tmp_path / "out").exists()
