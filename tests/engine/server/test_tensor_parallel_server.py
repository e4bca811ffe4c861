"""`nightshift serve --tensor-parallel-size 2`: a real server process on loopback serves with
two ranks, and when a worker dies or hangs it stops, exit code 1, within seconds (a supervisor
restarts it) rather than hanging or answering 503 forever; the requests in flight get an error,
and no process is left behind. A launch whose ranks cannot meet says why in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.server.live_server import build_chat_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Children of every thread of pid (the engine thread starts the workers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = task / "children"
        if children.exists():
            found += [int(p) for p in children.read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


NIGHTSHIFT = Path(sys.executable).with_name("nightshift")


def _serve(
    model: Path, port: int, *extra: str, env: dict | None = None, own_group: bool = False
) -> subprocess.Popen:
    """own_group: a process group of its own, for signals to the whole group (os.killpg)."""
    command = [str(NIGHTSHIFT), "serve", "--model", str(model), "--device", "cpu"]
    command += ["--port", str(port), "--tensor-parallel-size", "2", *extra]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=own_group,
        preexec_fn=_terminal_signals,
    )


def _terminal_signals() -> None:
    """The child starts with Ctrl-C and SIGTERM at their default actions, as from a shell. An
    ignored signal stays ignored across exec, and Python then keeps ignoring it: a test earlier
    in the suite that leaves the pytest process ignoring SIGINT made the server deaf to the
    Ctrl-C this file sends (two full CI runs, 2026-12-05; reproduced by running this file from
    a process that ignores SIGINT)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def _wait_healthy(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.3)
    raise AssertionError("the server did not come up")


def _worker_ranks(server: subprocess.Popen) -> list[int]:
    # The spawn start method's resource tracker is a child too; the rank is the one whose
    # command line names the worker entry point.
    workers = [p for p in _children(server.pid) if _alive(p)]
    return [p for p in workers if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_serves_with_two_ranks_and_exits_when_a_worker_dies(tmp_path):
    model = build_chat_model(tmp_path / "m")
    port = _free_port()
    server = _serve(model, port, "--num-kv-blocks", "64")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server)
        body = {"model": str(model), "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        workers = [p for p in _children(server.pid) if _alive(p)]
        rank = _worker_ranks(server)
        assert rank, "no worker process"
        os.kill(rank[0], signal.SIGKILL)
        code = server.wait(timeout=30)
        output = server.stdout.read()
        assert code == 1, output[-2000:]
        assert "the engine failed: tensor-parallel worker" in output
        assert not any(_alive(p) for p in workers)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_hung_worker_fails_the_stream_in_flight_and_the_server_exits(tmp_path):
    """A worker that stops without exiting (SIGSTOP: a machine gone without closing its
    connections looks the same) while a stream is decoding: the stream ends with an error
    event once the heartbeat is missed (10 s), not cut at the collective's timeout, and the
    server exits 1 soon after, the stopped worker killed."""
    model = build_chat_model(tmp_path / "m")
    port = _free_port()
    server = _serve(model, port)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server)
        [rank] = _worker_ranks(server)
        body = {"model": str(model), "prompt": "Hello", "max_tokens": 400, "stream": True}
        body.update(temperature=0, ignore_eos=True)
        lines, stopped_at = [], None
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                lines.append(line)
                if len(lines) == 10:
                    os.kill(rank, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        failed_after = time.monotonic() - stopped_at
        errors = [line for line in lines if '"error"' in line]
        assert errors and "sent no heartbeat" in errors[0], lines[-3:]
        assert failed_after < 25
        code = server.wait(timeout=30)
        output = server.stdout.read()
        assert code == 1, output[-2000:]
        assert "error: the engine failed: tensor-parallel rank 1 sent no heartbeat" in output
        assert not _alive(rank)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _rendezvous_env(**extra: str) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return dict(env, WORLD_SIZE="2", **extra)


def _run(command: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_a_lone_env_rank_gives_up_with_one_line(tmp_path):
    """Rank 0 without its rank 1, and rank 1 without its rank 0, end after the join timeout
    (here 3 s) naming who is missing, exit 1, no traceback."""
    model = build_chat_model(tmp_path / "m")
    command = [str(NIGHTSHIFT), "serve", "--model", str(model), "--device", "cpu", "-tp", "2"]
    command += ["--port", str(_free_port())]
    rank0 = _run(command, _rendezvous_env(RANK="0", NIGHTSHIFT_TP_JOIN_TIMEOUT="3"))
    assert rank0.returncode == 1, rank0.stderr[-2000:]
    last = rank0.stderr.strip().splitlines()[-1]
    assert last.startswith("error: tensor-parallel rank 0 of 2: rank 1 did not join at"), last
    assert "within 3 s" in last and "Traceback" not in rank0.stderr
    rank1 = _run(command, _rendezvous_env(RANK="1", NIGHTSHIFT_TP_JOIN_TIMEOUT="3"))
    assert rank1.returncode == 1, rank1.stderr[-2000:]
    last = rank1.stderr.strip().splitlines()[-1]
    assert "rank 1 of 2: rank 0 did not answer at 127.0.0.1:" in last, last
    assert "Traceback" not in rank1.stderr


def test_launch_mistakes_are_named_before_anything_loads(tmp_path):
    """Exit 2, one line each: the rendezvous port is the server's own or taken, WORLD_SIZE
    disagrees with -tp, data parallelism under torchrun's variables, a bad join timeout."""
    model = build_chat_model(tmp_path / "m")
    base = [str(NIGHTSHIFT), "serve", "--model", str(model), "--device", "cpu"]
    env = _rendezvous_env(RANK="0")
    cases = [
        (["-tp", "2", "--port", env["MASTER_PORT"]], env, "is also --port"),
        (["--port", str(_free_port())], env, "WORLD_SIZE is 2 (a torchrun-style launch of 2"),
        (["--data-parallel-size", "2", "--port", str(_free_port())], env, "WORLD_SIZE=2 is set"),
        (
            ["-tp", "2", "--port", str(_free_port())],
            dict(env, NIGHTSHIFT_TP_JOIN_TIMEOUT="soon"),
            "NIGHTSHIFT_TP_JOIN_TIMEOUT must be a number of seconds",
        ),
    ]
    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = dict(env, MASTER_PORT=str(taken.getsockname()[1]))
        cases.append((["-tp", "2", "--port", str(_free_port())], busy, "cannot listen on"))
        for args, case_env, expected in cases:
            result = _run(base + args, case_env)
            assert result.returncode == 2, (args, result.stderr[-2000:])
            assert expected in result.stderr.strip().splitlines()[-1], (args, result.stderr)
            assert "Traceback" not in result.stderr, args


# The drain tests check that the stream completes, not how fast: a 300-token stream of a TP group
# on a loaded 2-core machine can outlast the default 30 s grace period (seen in CI once).
DRAIN = ("--grace-period", "300")


def _stream_then(base: str, model: Path, after: int, action) -> tuple[int, list[str]]:
    """A 300-token stream; action() after its first `after` events; (events, error events)."""
    body = {"model": str(model), "prompt": "Hello", "max_tokens": 300, "stream": True}
    body.update(temperature=0, ignore_eos=True)
    lines = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            lines.append(line)
            if len(lines) == after:
                action()
    return len(lines), [line for line in lines if '"error"' in line]


def test_sigterm_to_the_whole_group_drains_the_stream_and_exits_0(tmp_path):
    """systemd (its control group), `timeout` or `kill -TERM -PGID` signal the worker too: it
    keeps computing until the server has drained, so the grace period holds."""
    model = build_chat_model(tmp_path / "m")
    port = _free_port()
    server = _serve(model, port, *DRAIN, own_group=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        workers = _worker_ranks(server)
        events, errors = _stream_then(
            f"http://127.0.0.1:{port}", model, 10, lambda: os.killpg(server.pid, signal.SIGTERM)
        )
        assert not errors and events > 300
        code = server.wait(timeout=60)
        assert code == 0, server.stdout.read()[-2000:]
        assert not any(_alive(p) for p in workers)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_sigterm_to_every_env_rank_drains_the_stream_and_both_exit_0(tmp_path):
    """Kubernetes deleting the StatefulSet signals both pods at once: rank 1 runs rank 0's
    steps until rank 0 has finished its requests and tells it to stop."""
    model = build_chat_model(tmp_path / "m")
    port = _free_port()
    env = _rendezvous_env()
    ranks = [_serve(model, port, *DRAIN, env=dict(env, RANK=str(rank))) for rank in (0, 1)]
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", ranks[0])

        def terminate_both() -> None:
            for rank in ranks:
                rank.send_signal(signal.SIGTERM)

        events, errors = _stream_then(f"http://127.0.0.1:{port}", model, 10, terminate_both)
        assert not errors and events > 300
        for rank in ranks:
            code = rank.wait(timeout=60)
            assert code == 0, rank.stdout.read()[-2000:]
        assert "SIGTERM received; running rank 0's steps until it stops" in ranks[1].stdout.read()
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


def test_ctrl_c_while_the_ranks_load_stops_every_process_quietly(tmp_path):
    """Ctrl-C in a terminal signals the whole group while the engine thread still builds (the
    worker perhaps still importing torch): the server exits 130 (an interrupt, no "engine
    failed" about the worker it was stopping, no trace from the worker), and no worker is
    left."""
    model = build_chat_model(tmp_path / "m")
    server = _serve(model, _free_port(), own_group=True)
    try:
        # The first lines: the thread count, then the group's join (the ranks load from here).
        first = server.stdout.readline()
        if first.startswith("torch threads: "):
            first = server.stdout.readline()
        assert "tensor-parallel rank 0 of 2: waiting for all ranks" in first, first
        workers = _worker_ranks(server)
        assert workers
        os.killpg(server.pid, signal.SIGINT)
        # Bounded: a server that never sees the signal (see _terminal_signals) must fail the
        # test, not hang the suite on an unbounded read.
        try:
            rest = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            pytest.fail("the server ignored Ctrl-C while its ranks loaded: running after 60 s")
        assert server.returncode == 130, rest[-2000:]
        assert "engine failed" not in rest and "Traceback" not in rest, rest[-2000:]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
