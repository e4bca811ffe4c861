"""Tensor parallelism: rank 0 in this process, the other ranks in worker processes.

Rank 0 is the engine's own process (vLLM v0's driver-worker layout): it schedules, holds its
shard, broadcasts each step's input on the control group, runs its share of the forward (whose
all-reduces and gathers need every rank) and samples from the gathered logits; the sampled
tokens reach the other ranks as the next step's input ids. Workers are started here with
torch.multiprocessing (spawn), or, under a torchrun-style env:// rendezvous, started by whoever
launched this process on each machine (`nightshift serve` on a rank above 0 is a worker).

A worker that dies ends the engine: a monitor thread sees its process exit, records why, aborts
the groups so no collective waits on it, and calls the failure callbacks (the server stops with
a non-zero exit). Any failure inside a step is fatal too: the ranks would no longer be in step.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import resource_tracker

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.distributed.rendezvous import (
    LOCAL_JOIN_TIMEOUT_S,
    Rendezvous,
    env_rendezvous,
    join_timeout,
    master_store,
    send_object,
    watch_heartbeats,
)
from engine.errors import ExecutorFailedError
from engine.executor.worker import SHUTDOWN, load_rank, spawned_worker, to_device
from engine.models.model_config import load_model_config
from engine.models.sharding import ShardPlan
from engine.runner import ModelRunner, RunnerOutput, StepInput
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

NO_MAIN_GUARD = (
    "the engine (tensor_parallel_size > 1) is built at the top level of the main module, which "
    'every worker process imports again: build it under `if __name__ == "__main__":`'
)
# How long an exiting process waits for an abandoned build to give up: it does at its next
# check of the ranks (every 50 ms), or once rank 0's own shard has loaded.
BUILD_GIVE_UP_S = 30.0
NO_MAIN_GUARD_EXIT = 78  # EX_CONFIG: how a worker that imported such a script tells rank 0


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, placement) -> None:
        size = config.tensor_parallel_size
        # The split is checked before anything starts: a model that cannot be split by `size`
        # fails here, in one line, with no process to clean up.
        ShardPlan(load_model_config(placement.model_dir), 0, size)
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self._closing = False
        self._procs: list[mp.Process] = []
        self._threads_before: int | None = None
        self._stop_watching = threading.Event()
        self._control = None
        self._tp = None
        # Set once this process is exiting while the build still runs (on the engine thread,
        # after Ctrl-C ended the main thread): the build gives up at its next check.
        self._abandoned: str | None = None
        self._built = threading.Event()
        env = env_rendezvous(size)
        atexit.register(self._stop_at_exit)
        try:
            if env is not None:
                rv, master, timeout = self._env_rank0(env), None, join_timeout()
            else:
                timeout = LOCAL_JOIN_TIMEOUT_S
                master = master_store(size)
                rv = Rendezvous("127.0.0.1", master.port, 0, size, 0)
                self._start_workers(config, placement, rv)
                # Watching from the start: a worker that fails to load ends the build too.
                threading.Thread(
                    target=self._monitor, name="nightshift-tp-monitor", daemon=True
                ).start()
            # Kept: the store lives as long as the engine (the heartbeats go through it).
            self._store = master
            model, self.num_blocks, self._tp, self._control = load_rank(
                config,
                placement,
                rv,
                master,
                join_timeout=timeout,
                # Ranks started elsewhere have no process to watch, and a hung one none either:
                # their heartbeats are watched from the moment they have joined.
                liveness=lambda: watch_heartbeats(rv, self._stop_watching, self._fail),
                failed=lambda: self.failure or self._abandoned,
            )
        except BaseException as e:
            self.shutdown()
            if self.failure is not None:
                raise ExecutorFailedError(self.failure) from e
            raise
        finally:
            self._built.set()
        self.model = model
        self.runner = ModelRunner(
            model, self.num_blocks, config.block_size, self._send_step, config.kv_cache_dtype
        )
        logger.info("tensor parallel: %d ranks (%s)", size, "env://" if env else "local workers")

    @staticmethod
    def _env_rank0(env: Rendezvous) -> Rendezvous:
        if env.rank != 0:
            raise ValueError(
                f"RANK {env.rank} is a tensor-parallel worker, not an engine: start it with "
                "`nightshift serve` (it joins rank 0 and runs its steps)"
            )
        return env

    def _start_workers(self, config: EngineConfig, placement, rv: Rendezvous) -> None:
        # The CPU is shared: each rank gets its share of the threads (on a GPU, one each).
        threads = max(1, (config.num_threads or torch.get_num_threads()) // rv.size)
        if placement.device.type == "cpu":
            self._threads_before = torch.get_num_threads()  # given back at shutdown
            torch.set_num_threads(threads)
        context = mp.get_context("spawn")
        if getattr(mp.current_process(), "_inheriting", False):
            # A spawned worker re-imports the main module; a script that builds the engine at
            # its top level would build it again in every worker. The worker says why and
            # exits with a code of its own, which rank 0 turns into the same advice.
            print(f"{type(self).__name__}: {NO_MAIN_GUARD}", file=sys.stderr, flush=True)
            os._exit(NO_MAIN_GUARD_EXIT)
        # Ctrl-C reaches the whole process group. A worker ignores it once it runs; blocked
        # here, the signal stays blocked in the worker from its first instruction, so a Ctrl-C
        # during its imports is no KeyboardInterrupt trace either (spawned_worker unblocks it).
        # (multiprocessing's resource tracker is started first: starting it unblocks SIGINT.)
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for rank in range(1, rv.size):
                worker = Rendezvous(rv.host, rv.port, rank, rv.size, rank)
                proc = context.Process(
                    target=spawned_worker,
                    args=(config, placement, worker, threads),
                    name=f"nightshift-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _stop_at_exit(self) -> None:
        """The process is exiting without shutdown(): a script that never called it, or Ctrl-C
        while the engine thread builds (the main thread ended; that thread cannot be
        interrupted). The workers are stopped here, before multiprocessing's own exit handler
        would terminate them under the monitor's eyes ("worker exited"), and a build still
        running is made to give up and clean up first: torn down under it at interpreter exit,
        its store and groups ended the process with std::terminate."""
        if not self._built.is_set():
            self._abandoned = "the process is exiting while the engine is being built"
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()
            self._built.wait(BUILD_GIVE_UP_S)
        self.shutdown()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.check_health()
        try:
            return self.runner.execute(sched)
        except Exception as e:
            # Whatever failed, the ranks are no longer in step: nothing can compute any more.
            reason = self.failure or f"a tensor-parallel step failed: {e}"
            self._fail(reason)
            raise ExecutorFailedError(reason) from e

    def _send_step(self, step: StepInput) -> None:
        send_object(self._control, to_device(step, torch.device("cpu")))

    def check_health(self) -> None:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)
        if self._closing:
            raise ExecutorFailedError("the tensor-parallel engine has been shut down")

    def _monitor(self) -> None:
        sentinels = {p.sentinel: p for p in self._procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing or self._abandoned:
            return
        proc = sentinels[ready[0]]
        proc.join(5)  # the process has ended: this only reaps it, for its exit code
        if proc.exitcode == NO_MAIN_GUARD_EXIT:
            self._fail(f"tensor-parallel worker {proc.name} could not start: {NO_MAIN_GUARD}")
        else:
            self._fail(f"tensor-parallel worker {proc.name} exited (code {proc.exitcode})")

    def _fail(self, reason: str) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = reason
        logger.error("engine failed: %s", reason)
        # The other workers can compute nothing more either. Killing them also unblocks a
        # collective this process waits in (a closed connection fails it at once; aborting the
        # group does not), so a hung worker fails the requests in flight within seconds.
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._abort_groups()
        for callback in list(self.on_failure):
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - the others must still hear of it
                logger.exception("a failure callback failed")

    def _abort_groups(self) -> None:
        for group in (self._tp.group if self._tp else None, self._control):
            if group is not None:
                try:
                    group.abort()
                except Exception:  # noqa: BLE001 - best effort: the process is ending anyway
                    pass

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop_watching.set()
        if self._control is not None and self.failure is None:
            try:
                send_object(self._control, SHUTDOWN)
            except Exception:  # noqa: BLE001 - a dead worker is killed below
                pass
        for proc in self._procs:
            proc.join(5)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self.failure is not None or any(p.exitcode != 0 for p in self._procs):
            # Only a broken group is aborted: aborting a healthy one left gloo's threads to be
            # torn down at exit, which once ended a clean run with std::terminate (exit -6).
            self._abort_groups()
        else:
            # A healthy control group ends here, while the interpreter runs: its destructor
            # joins gloo's threads, which then let go of the shutdown broadcast (its tensors
            # are still held, rendezvous._SENT). Left to the interpreter's exit, a thread that
            # let go of it late took the GIL while finalizing: std::terminate, exit -6.
            self._control = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        atexit.unregister(self._stop_at_exit)
