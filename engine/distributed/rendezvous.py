"""How tensor-parallel ranks find each other, and the control channel rank 0 drives them with.

Ranks meet at a TCPStore on rank 0 (torchrun's env:// variables: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK; or an address the engine picks when it starts its workers itself).
Two process groups come from it: the model's (NCCL on CUDA, gloo on CPU) for the all-reduces
and gathers inside the forward, and a gloo control group on which rank 0 broadcasts each step's
input. Both are owned by the engine, not registered as torch.distributed's default group.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.group import TensorParallel
from engine.distributed.identity import RankIdentity, mismatch

# The model group's collectives: long enough for a slow rank to finish a big prefill, short
# enough that a rank lost without a closed connection ends the engine rather than hanging it.
MODEL_TIMEOUT = timedelta(minutes=5)
# Workers wait for rank 0's next step for as long as the server is idle.
IDLE_TIMEOUT = timedelta(days=365)
# Liveness beside the collectives: each worker adds to its counter in the store every second;
# rank 0 declares a rank lost after this long without one (a rank on another machine can vanish
# without closing its connections), and a worker that cannot reach the store ends itself.
HEARTBEAT_S = 1.0
HEARTBEAT_LOST_S = 10.0
# How long ranks wait for each other at the start. Workers this process starts join within
# seconds (before they load weights); the ranks of an env:// launch get torchrun's default
# rendezvous timeout, or the environment's.
LOCAL_JOIN_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 600.0
JOIN_TIMEOUT_ENV = "NIGHTSHIFT_TP_JOIN_TIMEOUT"
JOIN_LOG_S = 30.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    host: str
    port: int
    rank: int
    size: int
    local_rank: int  # the rank's index on its own machine: which GPU it takes

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """torchrun's variables, when WORLD_SIZE is set; a missing or bad one is named."""
        if "WORLD_SIZE" not in os.environ:
            return None
        values = {}
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            if not os.environ.get(name):
                raise ValueError(
                    f"WORLD_SIZE is set, so ranks meet by env:// rendezvous, but {name} is not"
                )
            values[name] = os.environ[name]
        try:
            port, rank, size = (int(values[n]) for n in ("MASTER_PORT", "RANK", "WORLD_SIZE"))
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        except ValueError as e:
            raise ValueError(
                f"env:// rendezvous: MASTER_PORT, RANK, WORLD_SIZE must be integers: {e}"
            ) from None
        if not 0 <= rank < size:
            raise ValueError(f"env:// rendezvous: RANK {rank} is outside WORLD_SIZE {size}")
        if not 0 < port < 65536:
            raise ValueError(f"env:// rendezvous: MASTER_PORT {port} is not a TCP port")
        return cls(values["MASTER_ADDR"], port, rank, size, local_rank)

    def store(self, timeout: float) -> dist.TCPStore:
        """Rank 0 hosts the store (a port it cannot take is an OSError naming it); the others
        connect to it, retrying for up to timeout seconds while rank 0 starts."""
        where = f"{self.host}:{self.port}"
        try:
            if self.rank > 0:
                # Until rank 0 listens, torch's own retries print a C++ warning per attempt.
                _wait_for_listener(self.host, self.port, time.monotonic() + timeout)
            return dist.TCPStore(
                self.host,
                self.port,
                self.size,
                is_master=self.rank == 0,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, dist.DistError, TimeoutError) as e:
            if self.rank == 0:
                raise OSError(
                    f"tensor-parallel rank 0 cannot listen on MASTER_PORT {self.port} "
                    f"({_first_line(e)}): choose a free port, other than the server's --port"
                ) from None
            raise RendezvousError(
                f"tensor-parallel rank {self.rank} of {self.size}: rank 0 did not answer at "
                f"{where} within {timeout:g} s ({_first_line(e)}); start rank 0 with the same "
                "MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
            ) from None


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens: {e}") from None
            time.sleep(0.2)


def env_rendezvous(tensor_parallel_size: int) -> Rendezvous | None:
    """The env:// rendezvous this process is a rank of, if any (None for a one-rank launch);
    a WORLD_SIZE that is not the tensor-parallel size is refused rather than ignored."""
    env = Rendezvous.from_env()
    if env is None or (env.size == 1 and tensor_parallel_size == 1):
        return None
    if env.size != tensor_parallel_size:
        raise ValueError(
            f"WORLD_SIZE is {env.size} (a torchrun-style launch of {env.size} ranks) but "
            f"tensor_parallel_size is {tensor_parallel_size}: each rank of the env:// "
            f"rendezvous is one tensor-parallel rank; pass --tensor-parallel-size {env.size} "
            "to every rank, or unset WORLD_SIZE"
        )
    return env


def join_timeout() -> float:
    """Seconds the ranks of an env:// launch wait for each other (torchrun's default
    rendezvous timeout); ranks started by hand on several machines may need longer."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV, "")
    if not raw:
        return JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{JOIN_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def master_store(size: int) -> dist.TCPStore:
    """A store on a free loopback port, for workers this process starts itself."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        size,
        is_master=True,
        timeout=timedelta(seconds=LOCAL_JOIN_TIMEOUT_S),
        wait_for_workers=False,
    )


def join(
    rv: Rendezvous,
    device: torch.device,
    master: dist.TCPStore | None = None,
    *,
    identity: RankIdentity,
    timeout: float,
    failed: Callable[[], str | None] = lambda: None,
) -> tuple[TensorParallel, dist.ProcessGroup, dist.Store]:
    """(the model's group, the control group, the store), once every rank has joined with the
    same identity (model, dtype, context length...: a rank that differs is refused here, by
    every rank, before anything loads). Waits at most timeout seconds, and gives up at once
    when failed() names a reason (a worker this process started has exited): a rank that never
    comes must not leave the others waiting inside gloo's constructor, which nothing can
    interrupt."""
    logger.info(
        "tensor-parallel rank %d of %d: waiting for all ranks at %s:%d",
        rv.rank,
        rv.size,
        rv.host,
        rv.port,
    )
    deadline = time.monotonic() + timeout
    store = master if master is not None else rv.store(timeout)
    _check_in(rv, store, identity, deadline, timeout, failed)
    try:
        # Created with what is left of the join's time (gloo connects every pair in its
        # constructor), then given their working timeouts.
        left = timedelta(seconds=max(10.0, deadline - time.monotonic()))
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rv.rank, rv.size, left)
        control.set_timeout(IDLE_TIMEOUT)
        model_store = dist.PrefixStore("model", store)
        if device.type == "cuda":
            group = dist.ProcessGroupNCCL(model_store, rv.rank, rv.size)
        else:
            group = dist.ProcessGroupGloo(model_store, rv.rank, rv.size, left)
            group.set_timeout(MODEL_TIMEOUT)
    except (RuntimeError, dist.DistError) as e:  # torch's text is a C++ trace: one line here
        raise RendezvousError(
            f"tensor-parallel rank {rv.rank} of {rv.size}: the ranks did not all meet at "
            f"{rv.host}:{rv.port} ({_first_line(e)}); start every rank with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
        ) from None
    return TensorParallel(rv.rank, rv.size, group), control, store


def min_over_ranks(
    rv: Rendezvous, store: dist.Store, value: int, failed: Callable[[], str | None]
) -> int:
    """The smallest value any rank offers (each rank's KV pool, once it has loaded its shard),
    through the store rather than a collective: rank 0 gives up as soon as failed() names a
    rank lost while loading, where a collective would wait for it."""
    offers = dist.PrefixStore("min", store)
    keys = [str(rank) for rank in range(rv.size)]
    try:
        offers.set(keys[rv.rank], str(value))
        while not offers.check(keys):
            reason = failed()
            if reason is not None:
                raise RendezvousError(reason)
            time.sleep(0.05)
        return min(int(offers.get(key)) for key in keys)
    except RendezvousError:
        raise
    except (RuntimeError, dist.DistError) as e:  # the store went away: rank 0 is gone
        raise _store_gone(rv, "the ranks loaded", e) from None


def _check_in(
    rv: Rendezvous,
    store: dist.Store,
    identity: RankIdentity,
    deadline: float,
    timeout: float,
    failed: Callable[[], str | None],
) -> None:
    """Each rank publishes its identity, waits until every rank has, then compares: rank 0
    with every rank, the others with rank 0, so each side of a mismatch says so and exits."""
    joined = dist.PrefixStore("joined", store)
    keys = [str(rank) for rank in range(rv.size)]
    next_log = time.monotonic() + JOIN_LOG_S
    try:
        joined.set(keys[rv.rank], identity.to_json())
        while True:
            missing = [rank for rank, key in enumerate(keys) if not joined.check([key])]
            if not missing:
                _compare(rv, joined, identity)
                return
            reason = failed()
            if reason is not None:
                raise RendezvousError(reason)
            now = time.monotonic()
            if now > deadline:
                raise RendezvousError(
                    f"tensor-parallel rank {rv.rank} of {rv.size}: {_ranks(missing)} did not "
                    f"join at {rv.host}:{rv.port} within {timeout:g} s; start every rank with "
                    f"the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE ({JOIN_TIMEOUT_ENV} "
                    "sets the wait)"
                )
            if now > next_log:
                logger.info("tensor-parallel rank %d: waiting for %s", rv.rank, _ranks(missing))
                next_log = now + JOIN_LOG_S
            time.sleep(0.05)
    except RendezvousError:
        raise
    except (RuntimeError, dist.DistError) as e:  # the store went away: rank 0 is gone
        raise _store_gone(rv, "the ranks were joining", e) from None


def _compare(rv: Rendezvous, joined: dist.Store, mine: RankIdentity) -> None:
    for other in range(1, rv.size) if rv.rank == 0 else (0,):
        theirs = RankIdentity.from_json(joined.get(str(other)).decode())
        problem = mismatch(rv.rank, mine, other, theirs)
        if problem is not None:
            raise RankMismatchError(problem)


def _store_gone(rv: Rendezvous, during: str, e: BaseException) -> RendezvousError:
    return RendezvousError(
        f"tensor-parallel rank {rv.rank} of {rv.size}: rank 0's store at {rv.host}:{rv.port} "
        f"went away while {during} ({_first_line(e)})"
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


class RendezvousError(RuntimeError):
    """The ranks of a tensor-parallel group never all joined."""


class RankMismatchError(RendezvousError):
    """The ranks joined, but were started with different models or options: a launch mistake
    that a restart does not mend."""


# The tensors of the last few control broadcasts, kept alive from Python. gloo's worker thread
# lets go of a finished broadcast a moment after wait() returns; were the Python tensor already
# gone, that release would hand the tensor's Python object back and take the GIL for it. After
# the last broadcast (the shutdown) the process exits at once, and a thread taking the GIL while
# the interpreter finalizes is ended by pthread_exit through a noexcept frame: std::terminate,
# exit -6 (seen in 2 of 10 clean env:// runs on a 2-core VM; core dump: ~AsyncBroadcastWork ->
# decref_pyobject -> take_gil -> PyThread_exit_thread).
_SENT: deque[torch.Tensor] = deque(maxlen=4)


def send_object(control: dist.ProcessGroup, obj: object) -> None:
    """Rank 0: obj to every other rank (pickled, so ranks must trust each other: they are one
    engine; tensors in it should be on the CPU)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    control.broadcast([length]).wait()
    control.broadcast([data]).wait()
    _SENT.extend((length, data))


def receive_object(control: dist.ProcessGroup) -> object:
    """The other ranks: what rank 0 sent."""
    length = torch.zeros(1, dtype=torch.int64)
    control.broadcast([length]).wait()
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    control.broadcast([data]).wait()
    _SENT.extend((length, data))
    return pickle.loads(data.numpy().tobytes())


def _client(rv: Rendezvous) -> dist.TCPStore:
    """A connection of this thread's own to rank 0's store."""
    return dist.TCPStore(
        rv.host,
        rv.port,
        rv.size,
        is_master=False,
        timeout=timedelta(seconds=HEARTBEAT_LOST_S),
        wait_for_workers=False,
    )


def start_heartbeat(rv: Rendezvous, stop: threading.Event) -> None:
    """A worker's: count up in the store every HEARTBEAT_S; rank 0 gone (the store unreachable)
    ends this process, since it can never be sent another step."""

    def beat() -> None:
        try:
            store = _client(rv)
            while not stop.wait(HEARTBEAT_S):
                store.add(f"heartbeat/{rv.rank}", 1)
        except Exception as e:  # noqa: BLE001 - rank 0 is gone: nothing left to compute for
            if not stop.is_set():
                logger.error("rank %d: rank 0's store is unreachable (%s); exiting", rv.rank, e)
                os._exit(1)

    threading.Thread(target=beat, name=f"nightshift-heartbeat-{rv.rank}", daemon=True).start()


def watch_heartbeats(rv: Rendezvous, stop: threading.Event, on_lost: Callable[[str], None]) -> None:
    """Rank 0's: call on_lost once a worker's counter has not moved for HEARTBEAT_LOST_S."""

    def watch() -> None:
        try:
            store = _client(rv)
            seen = {rank: (-1, time.monotonic()) for rank in range(1, rv.size)}
            while not stop.wait(HEARTBEAT_S):
                now = time.monotonic()
                for rank, (count, at) in seen.items():
                    current = store.add(f"heartbeat/{rank}", 0)
                    if current != count:
                        seen[rank] = (current, now)
                    elif now - at > HEARTBEAT_LOST_S:
                        on_lost(
                            f"tensor-parallel rank {rank} sent no heartbeat for "
                            f"{HEARTBEAT_LOST_S:g} s"
                        )
                        return
        except Exception as e:  # noqa: BLE001 - the store is this process's own: it is ending
            if not stop.is_set():
                on_lost(f"the rendezvous store failed: {e}")

    threading.Thread(target=watch, name="nightshift-heartbeat-watch", daemon=True).start()
