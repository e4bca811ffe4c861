"""Tensor parallelism on CPU with gloo, two ranks: greedy output token-identical to one rank and
to HF transformers (logprobs within 1e-4) through chunked prefill, prefix hits, preemption and
speculative decoding; a dead worker fails the engine at once; the env:// rendezvous; nothing
left running after shutdown."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import ExecutorFailedError, ModelLoadError
from engine.models.model_config import load_model_config
from engine.models.sharding import ShardPlan
from tests.engine.tiny_models import build_tiny_model, hf_greedy, load_hf

MAX_NEW = 10
REPO = Path(__file__).resolve().parents[2]

# Every mechanism at once: a 24-token budget chunks the prompts, 12 blocks of 16 force
# preemption among 8 requests, half the prompts share a 40-token prefix, and n-gram lookup
# proposes drafts from the prompts' repeats.
CRAMPED = dict(
    block_size=16,
    num_kv_blocks=12,
    max_num_seqs=8,
    max_num_batched_tokens=24,
    enable_prefix_caching=True,
    speculative="ngram",
    prompt_lookup_min=1,
    prompt_lookup_max=3,
    num_speculative_tokens=3,
    device="cpu",
)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(2, vocab) for _ in range(40)]
    prompts = []
    for i, n in enumerate([1, 5, 17, 30, 45, 60, 20, 9]):
        tail = [rng.randrange(2, vocab) for _ in range(n)]
        tail += tail[: n // 2]  # repeats: something for n-gram lookup to propose
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


MODELS = {
    "llama-gqa": ("llama", {}),  # 4 heads, 2 KV heads: one KV head per rank
    "llama-1kv-tied": ("llama", {"num_key_value_heads": 1, "tied": True}),  # KV head replicated
    "qwen2-bias-odd-vocab": ("qwen2", {"vocab_size": 383}),  # biases split; vocab padded
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_case(request, tmp_path_factory):
    family, overrides = MODELS[request.param]
    overrides = dict(overrides)
    tied = overrides.pop("tied", False)
    path = build_tiny_model(family, tmp_path_factory.mktemp(request.param), tied=tied, **overrides)
    hf = load_hf(path)
    prompts = _prompts(hf.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _check(results, expected) -> None:
    for result, (tokens, logprobs) in zip(results, expected, strict=True):
        assert result.outputs[0].token_ids == tokens
        for step, (ours, ref) in enumerate(zip(result.outputs[0].logprobs, logprobs)):
            for token, value in ours.items():
                assert abs(value - ref[token].item()) < 1e-4, (step, token)


def test_two_ranks_match_one_rank_and_hf(model_case):
    path, prompts, expected = model_case
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    single = LLM(model=str(path), **CRAMPED)
    one_rank = [r.outputs[0].token_ids for r in single.generate(prompts, params)]
    tp = LLM(model=str(path), tensor_parallel_size=2, **CRAMPED)
    try:
        for _ in range(2):  # the second pass hits the prefix cache the first left
            results = tp.generate(prompts, params)
            _check(results, expected)
            assert [r.outputs[0].token_ids for r in results] == one_rank
        core = tp.engine.core
        assert core.scheduler.num_preemptions > 0
        assert core.kv.prefix_stats.hit_tokens > 0
        assert core.spec_stats.num_draft_tokens > 0
        core.kv.check_integrity()
        assert core.kv.stats().num_used == 0
        # Each rank holds half the query heads, and its KV pool half the KV heads (or the
        # single KV head, replicated).
        model = core.executor.model
        config = load_model_config(path)
        assert model.num_heads == config.num_heads // 2
        assert model.num_kv_heads == max(1, config.num_kv_heads // 2)
        assert core.executor.runner.kv_caches[0][0].shape[2] == model.num_kv_heads
        # A rank holds its slices only, densely (a strided view would keep the whole tensor).
        for layer in model.layers:
            for weight in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                assert weight.is_contiguous()
                assert weight.untyped_storage().nbytes() == weight.numel() * weight.itemsize
    finally:
        tp.shutdown()


def test_draft_model_speculation_with_two_ranks(tmp_path):
    """A draft model runs whole on rank 0 and writes its K/V into the lookahead slots the
    scheduler reserves; the output is the target's greedy output."""
    target = build_tiny_model("llama", tmp_path / "target")
    draft = build_tiny_model("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    prompts = _prompts(384)[:4]
    expected = [hf_greedy(load_hf(target), p, MAX_NEW)[0] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    options = dict(CRAMPED, speculative="draft", draft_model=str(draft), num_kv_blocks=64)
    del options["prompt_lookup_min"], options["prompt_lookup_max"]
    llm = LLM(model=str(target), tensor_parallel_size=2, **options)
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == expected
        assert llm.engine.core.spec_stats.num_draft_tokens > 0
        llm.engine.core.kv.check_integrity()
    finally:
        llm.shutdown()


def test_a_dead_worker_fails_the_engine_at_once(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m")
    llm = LLM(model=str(path), tensor_parallel_size=2, device="cpu")
    executor = llm.engine.core.executor
    worker = executor._procs[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while executor.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "exited" in (executor.failure or "")
    start = time.monotonic()
    with pytest.raises(ExecutorFailedError, match="exited"):
        llm.generate([[5, 6, 7]], params)
    assert time.monotonic() - start < 5
    llm.shutdown()
    assert not worker.is_alive()


def test_a_hung_worker_fails_the_engine_by_its_missing_heartbeat(tmp_path):
    """A rank that stops without exiting (here SIGSTOP; a machine gone without closing its
    connections looks the same) is declared lost once its heartbeat stops."""
    path = build_tiny_model("llama", tmp_path / "m")
    llm = LLM(model=str(path), tensor_parallel_size=2, device="cpu")
    executor = llm.engine.core.executor
    os.kill(executor._procs[0].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while executor.failure is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "sent no heartbeat" in (executor.failure or "")
    with pytest.raises(ExecutorFailedError, match="heartbeat"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    llm.shutdown()
    assert not executor._procs[0].is_alive()


def test_a_worker_that_dies_before_joining_fails_the_build_at_once(tmp_path):
    """A script that builds the engine at its top level (no `__main__` guard) makes each
    spawned worker build it again: the worker refuses and exits before it joins. Rank 0 must
    not wait for it inside gloo's constructor, which nothing can interrupt."""
    path = build_tiny_model("llama", tmp_path / "m")
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"from engine import LLM\nLLM(model={str(path)!r}, tensor_parallel_size=2, device='cpu')\n"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 1
    # The error rank 0 raises gives the advice itself, not only the worker's exit code.
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("engine.errors.ExecutorFailedError: tensor-parallel worker "), last
    assert "could not start: the engine (tensor_parallel_size > 1) is built at the top" in last
    assert 'build it under `if __name__ == "__main__":`' in last
    assert time.monotonic() - start < 60


def test_a_world_size_that_is_not_the_split_is_refused(tmp_path, monkeypatch):
    path = build_tiny_model("llama", tmp_path / "m")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE is 2 .* but tensor_parallel_size is 1"):
        LLM(model=str(path), device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: one rank, fine
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    assert LLM(model=str(path), device="cpu").generate([[5, 6]], SamplingParams(max_tokens=1))


def test_shutdown_leaves_no_worker(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m")
    llm = LLM(model=str(path), tensor_parallel_size=2, device="cpu")
    workers = list(llm.engine.core.executor._procs)
    assert all(w.is_alive() for w in workers)
    llm.shutdown()
    assert not any(w.is_alive() for w in workers)
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="this LLM has been shut down"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1))
    with pytest.raises(ExecutorFailedError, match="has been shut down"):
        llm.engine.core.executor.execute(None)


def test_a_split_that_does_not_divide_is_refused_before_anything_starts(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match="does not divide the model's 4 attention heads"):
        LLM(model=str(path), tensor_parallel_size=3, device="cpu")
    config = load_model_config(path)
    with pytest.raises(ModelLoadError, match="KV heads"):
        ShardPlan(config.__class__(**{**_fields(config), "num_kv_heads": 3}), 0, 2)


def _fields(config) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from engine import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], tensor_parallel_size=2, device="cpu")
        out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=6,
                           ignore_eos=True))
        print(json.dumps([o.outputs[0].token_ids for o in out]))
        llm.shutdown()
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous_env() -> dict:
    """torchrun's variables for two ranks on loopback (RANK is each process's own)."""
    return dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        PYTHONPATH=str(REPO),
    )


def test_env_rendezvous_joins_ranks_started_apart(tmp_path):
    """torchrun's variables: rank 0 runs the engine (here the offline API), rank 1 is
    `nightshift serve` on the same variables, a worker that runs rank 0's steps and exits
    when rank 0 shuts down."""
    path = build_tiny_model("llama", tmp_path / "m")
    script = tmp_path / "rank0.py"
    script.write_text(RANK_SCRIPT)
    env = _rendezvous_env()
    nightshift = Path(sys.executable).with_name("nightshift")
    worker = subprocess.Popen(
        [str(nightshift), "serve", "--model", str(path), "--device", "cpu", "-tp", "2"],
        env=dict(env, RANK="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        rank0 = subprocess.run(
            [sys.executable, str(script), str(path)],
            env=dict(env, RANK="0"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rank0.returncode == 0, rank0.stderr[-2000:]
        expected = LLM(model=str(path), device="cpu").generate(
            [[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        tokens = json.loads(rank0.stdout.strip().splitlines()[-1])
        assert tokens == [o.outputs[0].token_ids for o in expected]
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_an_env_rank_ends_itself_when_rank_0_is_killed(tmp_path):
    """Rank 1 of a torchrun-style launch has no parent to die with: once rank 0's store is
    gone, its heartbeat fails and it exits."""
    path = build_tiny_model("llama", tmp_path / "m")
    env = _rendezvous_env()
    nightshift = Path(sys.executable).with_name("nightshift")
    command = [str(nightshift), "serve", "--model", str(path), "--device", "cpu", "-tp", "2"]
    port = _free_port()
    ranks = [
        subprocess.Popen(
            command + ["--port", str(port)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in (0, 1)
    ]
    try:
        import httpx

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        else:
            raise AssertionError("rank 0 did not come up")
        ranks[0].kill()
        ranks[0].wait()
        assert ranks[1].wait(timeout=40) != 0
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("difference", ["weights", "max_model_len"])
def test_ranks_started_differently_are_refused_by_every_rank(tmp_path, difference):
    """Ranks of an env:// launch each have their own command line and model folder: another
    checkpoint of the same shapes served wrong text, another vocabulary or context length
    crashed the group at the first request. Both ranks must refuse when they meet, exit 2,
    naming what differs."""
    path = build_tiny_model("llama", tmp_path / "m")
    other, extra = path, []
    if difference == "weights":
        other = build_tiny_model("llama", tmp_path / "other", seed=1)
        said = "the model ({here} here, {there} on rank {peer}: different checkpoint files)"
    else:
        extra = ["--max-model-len", "64"]
        said = "max_model_len ({here} here, {there} on rank {peer})"
    env = _rendezvous_env()
    nightshift = Path(sys.executable).with_name("nightshift")
    command = [str(nightshift), "serve", "--device", "cpu", "-tp", "2"]
    rank1 = subprocess.Popen(
        command + ["--model", str(other), *extra],
        env=dict(env, RANK="1"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rank0 = subprocess.run(
            command + ["--model", str(path), "--port", str(_free_port())],
            env=dict(env, RANK="0"),
            capture_output=True,
            text=True,
            timeout=90,
        )
        _, rank1_err = rank1.communicate(timeout=30)
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()
    values = {"weights": (path, other), "max_model_len": (512, 64)}[difference]
    for rank, code, err in ((0, rank0.returncode, rank0.stderr), (1, rank1.returncode, rank1_err)):
        here, there = values if rank == 0 else values[::-1]
        last = err.strip().splitlines()[-1]
        assert code == 2, err[-2000:]
        assert last.startswith(f"error: tensor-parallel rank {rank} was started differently")
        assert said.format(here=here, there=there, peer=1 - rank) in last
        assert "Traceback" not in err


SILENT_RANK = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from engine.config import EngineConfig
    from engine.distributed.identity import rank_identity
    from engine.distributed.rendezvous import Rendezvous, join
    from engine.engine_builder import place
    from engine.models.model_config import load_model_config
    config = EngineConfig(model=sys.argv[1], device="cpu", tensor_parallel_size=2)
    placement = place(config, Path(sys.argv[1]), load_model_config(Path(sys.argv[1])))
    identity = rank_identity(config, placement)
    join(Rendezvous.from_env(), torch.device("cpu"), identity=identity, timeout=60)
    time.sleep(60)  # joined, then gone quiet: no heartbeat, no shard, no KV pool offered
    """
)

BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from engine import LLM
    if __name__ == "__main__":
        try:
            LLM(model=sys.argv[1], tensor_parallel_size=2, device="cpu")
        except Exception as e:
            print(f"{type(e).__name__}: {e}")
            sys.exit(3)
    """
)


def test_a_rank_lost_while_the_shards_load_fails_the_build(tmp_path):
    """A rank on another machine that joins and then vanishes before it has loaded (no
    closed connection to notice): rank 0 must not wait for its KV pool size forever; its
    missing heartbeat ends the build."""
    path = build_tiny_model("llama", tmp_path / "m")
    (tmp_path / "silent.py").write_text(SILENT_RANK)
    (tmp_path / "build.py").write_text(BUILD_SCRIPT)
    env = _rendezvous_env()
    silent = subprocess.Popen(
        [sys.executable, str(tmp_path / "silent.py"), str(path)], env=dict(env, RANK="1")
    )
    try:
        start = time.monotonic()
        rank0 = subprocess.run(
            [sys.executable, str(tmp_path / "build.py"), str(path)],
            env=dict(env, RANK="0"),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert rank0.returncode == 3, rank0.stderr[-2000:]
        assert "ExecutorFailedError: tensor-parallel rank 1 sent no heartbeat" in rank0.stdout
        assert time.monotonic() - start < 45
    finally:
        silent.kill()
        silent.wait()


def test_prompt_logprobs_and_embeddings_with_two_ranks(tmp_path):
    """Rows beyond the sampled ones (prompt logprobs) go through the split LM head on every
    rank; pooled hidden states come from rank 0's (replicated) hidden states."""
    path = build_tiny_model("qwen2", tmp_path / "m")
    prompts = _prompts(384)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    single = LLM(model=str(path), device="cpu", max_num_batched_tokens=32)
    tp = LLM(model=str(path), device="cpu", max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        for ours, ref in zip(tp.generate(prompts, params), single.generate(prompts, params)):
            assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
            assert len(ours.prompt_logprobs) == len(ref.prompt_logprobs)
            for a, b in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
        for ours, ref in zip(tp.embed(prompts), single.embed(prompts)):
            assert max(abs(x - y) for x, y in zip(ours.embedding, ref.embedding)) < 1e-5
    finally:
        tp.shutdown()
