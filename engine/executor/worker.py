"""A tensor-parallel rank other than 0: it loads its shard, sizes its KV pool with the others,
then runs every step rank 0 sends until told to stop. It never schedules or samples: the step's
input says what to compute, and its collectives finish rank 0's forward."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.cpu_threads import apply_threads
from engine.distributed.identity import rank_identity
from engine.distributed.rendezvous import (
    LOCAL_JOIN_TIMEOUT_S,
    Rendezvous,
    join,
    min_over_ranks,
    receive_object,
    start_heartbeat,
)
from engine.runner import ModelRunner, StepInput

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"


def rank_device(placement_device: torch.device, local_rank: int) -> torch.device:
    """Each rank's own GPU (its local rank on its machine); the CPU is shared."""
    if placement_device.type != "cuda":
        return placement_device
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def load_rank(
    config: EngineConfig,
    placement,
    rv: Rendezvous,
    master=None,
    *,
    join_timeout: float,
    liveness: Callable[[], None],
    failed: Callable[[], str | None] = lambda: None,
):
    """Join the group, load this rank's shard and size the KV pool as every rank does: the
    smallest pool any rank can hold is everybody's. Returns (model, runner-ready block count,
    group, control group). join_timeout, failed: as join(). liveness: called once the ranks
    have met, before the shards load (which takes a while): a worker's heartbeat starts, rank
    0's watch of them."""
    from engine.engine_builder import kv_blocks
    from engine.models.loader import load_model

    device = rank_device(placement.device, rv.local_rank)
    placement = replace(placement, device=device)
    identity = rank_identity(config, placement)
    tp, control, store = join(
        rv, device, master, identity=identity, timeout=join_timeout, failed=failed
    )
    liveness()
    model = load_model(
        placement.model_dir,
        placement.dtype,
        device,
        placement.max_model_len,
        placement.kernels,
        tp,
        quantization=placement.quantization,
        group_size=placement.quant_group_size,
    )
    blocks, _ = kv_blocks(config, model, placement)
    return model, min_over_ranks(rv, store, blocks, failed), tp, control


def run_worker(config: EngineConfig, placement, rv: Rendezvous, join_timeout: float) -> None:
    stop = threading.Event()
    try:
        _serve_steps(config, placement, rv, join_timeout, stop)
    finally:
        stop.set()  # before rank 0's store goes away: a clean exit, not a lost rank 0


def _serve_steps(
    config: EngineConfig, placement, rv: Rendezvous, join_timeout: float, stop: threading.Event
) -> None:
    model, num_blocks, _, control = load_rank(
        config,
        placement,
        rv,
        join_timeout=join_timeout,
        liveness=lambda: start_heartbeat(rv, stop),
    )
    runner = ModelRunner(model, num_blocks, config.block_size, kv_cache_dtype=config.kv_cache_dtype)
    logger.info("tensor-parallel rank %d/%d ready: %d KV blocks", rv.rank, rv.size, num_blocks)
    defer_stop_signals(rv.rank)
    with torch.inference_mode():
        while True:
            message = receive_object(control)
            if message == SHUTDOWN:
                return
            assert isinstance(message, StepInput)
            runner.run(to_device(message, model.device))


def to_device(step: StepInput, device: torch.device) -> StepInput:
    meta = step.meta
    if step.input_ids.device == device:
        return step
    return StepInput(
        step.input_ids.to(device),
        step.positions.to(device),
        replace(
            meta,
            slot_mapping=meta.slot_mapping.to(device),
            block_tables=meta.block_tables.to(device),
            seq_lens=meta.seq_lens.to(device),
            cache={},
        ),
        step.logit_rows,
    )


def defer_stop_signals(rank: int) -> None:
    """A ready worker outlives its first SIGTERM or SIGINT: a supervisor (systemd's control
    group, Kubernetes deleting every pod of the group, Ctrl-C in a terminal) signals every rank
    at once, and rank 0 must still finish its requests in flight, which need every rank. The
    worker ends when rank 0 tells it to, when rank 0 is gone, or at a second signal."""
    received = []

    def defer(signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if received:
            logger.warning("rank %d: %s again; exiting", rank, name)
            os._exit(128 + signum)
        received.append(signum)
        logger.info("rank %d: %s received; running rank 0's steps until it stops", rank, name)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, defer)


def spawned_worker(config: EngineConfig, placement, rv: Rendezvous, threads: int) -> None:
    """The entry point of a worker process the engine started (torch.multiprocessing spawn)."""
    # Ctrl-C reaches the whole process group: rank 0 handles it and stops this worker. (Rank 0
    # started this process with SIGINT blocked, so none arrived before this line.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rv.rank} %(levelname)s %(message)s"
    )
    apply_threads(threads)  # its share of rank 0's count (MultiprocExecutor)
    try:
        run_worker(config, placement, rv, LOCAL_JOIN_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the exit code tells rank 0; the log says why
        logger.exception("tensor-parallel rank %d failed", rv.rank)
        sys.stderr.flush()
        os._exit(1)
