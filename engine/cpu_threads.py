"""How many CPU threads torch gets: `--threads N` when given, else OMP_NUM_THREADS when set, else
the physical cores this process may actually use.

torch's own default is every core of the machine. On a shared host, in a container or under
`taskset`, that is more threads than the process has CPUs: the threads of one matmul then wait
on each other (and on the neighbours) at every barrier, and a step's time swings by several
times. What the process may use is the smallest of three limits:
- its CPU affinity (os.sched_getaffinity: taskset, cpuset cgroups, Kubernetes static CPUs);
- its cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`: docker
  --cpus, Kubernetes limits), in CPUs, rounded down, on the process's cgroup and its parents;
- physical cores, not SMT siblings: two hyperthreads of one core share its matmul units, so a
  second torch thread there adds contention, not speed (thread_siblings_list, else core_id).

The file locations are a SysPaths, so tests feed fake sysfs and cgroup trees."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)
_last_logged: tuple[str, ThreadChoice] | None = None  # configure_threads' last line


@dataclass(frozen=True, slots=True)
class SysPaths:
    """Where the kernel describes CPUs and cgroups (fake trees in tests)."""

    cpu_dir: Path = Path("/sys/devices/system/cpu")  # cpuN/topology/...
    cgroup_root: Path = Path("/sys/fs/cgroup")  # v2 unified, or v1 one folder per controller
    proc_cgroup: Path = Path("/proc/self/cgroup")  # which cgroup the process is in


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The CPUs this process may use, and how many torch threads that makes."""

    cpus: tuple[int, ...]  # CPU affinity
    physical_cores: int  # distinct cores among `cpus` (SMT siblings once)
    quota: float | None  # cgroup CPU quota in CPUs; None: no quota

    @property
    def threads(self) -> int:
        cores = self.physical_cores
        if self.quota is not None:
            cores = min(cores, math.floor(self.quota))
        return max(1, cores)

    def describe(self) -> str:
        """e.g. 'physical cores available: affinity 0-3 (2 cores), cgroup quota 2.0'."""
        quota = "no cgroup quota" if self.quota is None else f"cgroup quota {round(self.quota, 2)}"
        cores = f"{self.physical_cores} core{'s' * (self.physical_cores != 1)}"
        return f"physical cores available: affinity {cpu_list(self.cpus)} ({cores}), {quota}"


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    threads: int
    source: str  # "--threads", "OMP_NUM_THREADS" or "available cores"
    budget: CpuBudget = field(compare=False)

    @property
    def above_budget(self) -> bool:
        return self.threads > self.budget.threads

    def describe(self) -> str:
        """e.g. '2 (physical cores available: affinity 0-3 (2 cores), cgroup quota 2.0)'."""
        if self.source == "available cores":
            return f"{self.threads} ({self.budget.describe()})"
        return f"{self.threads} ({self.source}; {self.budget.describe()})"


# More threads than any host has cores: torch's OpenMP pool crashes the process on counts in the
# tens of thousands (SIGSEGV, or libgomp "Out of memory allocating ... bytes"), not a warning.
MAX_THREADS = 1024


def check_threads(threads: int | None, option: str = "--threads") -> int | None:
    """A thread count a user gave: None (the default) or 1 to MAX_THREADS."""
    if threads is not None and threads < 1:
        raise ValueError(f"{option} must be at least 1, not {threads}")
    if threads is not None and threads > MAX_THREADS:
        raise ValueError(f"{option} must be at most {MAX_THREADS}, not {threads}")
    return threads


def detect_budget(
    paths: SysPaths | None = None, affinity: Iterable[int] | None = None
) -> CpuBudget:
    """What this process may use now. affinity: the CPUs (default: os.sched_getaffinity)."""
    paths = paths or SysPaths()
    if affinity is None:
        affinity = _affinity()
    cpus = tuple(sorted(set(affinity)))
    return CpuBudget(cpus, physical_cores(cpus, paths.cpu_dir), cgroup_quota(paths))


def choose_threads(
    requested: int | None,
    *,
    environ: Mapping[str, str] | None = None,
    budget: CpuBudget | None = None,
) -> ThreadChoice:
    """The thread count and where it came from: `requested`, else OMP_NUM_THREADS (which a
    launcher such as `serve --data-parallel-size` sets to split the cores), else the budget."""
    check_threads(requested)
    budget = budget or detect_budget()
    if requested is not None:
        return ThreadChoice(requested, "--threads", budget)
    env = os.environ if environ is None else environ
    omp = _omp_num_threads(env.get("OMP_NUM_THREADS"))
    if omp is not None:
        return ThreadChoice(omp, "OMP_NUM_THREADS", budget)
    return ThreadChoice(budget.threads, "available cores", budget)


def configure_threads(requested: int | None, label: str = "torch threads") -> ThreadChoice:
    """Choose, apply to torch, and log the count and its source (a warning when it is more than
    the process's cores: the threads would wait on each other)."""
    global _last_logged
    choice = choose_threads(requested)
    applied = apply_threads(choice.threads)
    if applied != choice.threads:  # not seen; would make the line below a lie
        logger.warning("%s: asked torch for %d, it uses %d", label, choice.threads, applied)
    # Once per process and count: a benchmark builds several engines with the same one.
    again = (label, choice) == _last_logged
    logger.log(logging.DEBUG if again else logging.INFO, "%s: %s", label, choice.describe())
    _last_logged = (label, choice)
    if choice.above_budget and not again:
        logger.warning(
            "%s: %d (%s) is more than the %d physical cores available to this process: the "
            "threads will contend for them",
            label,
            choice.threads,
            choice.source,
            choice.budget.threads,
        )
    return choice


def apply_threads(threads: int) -> int:
    """torch's intra-op threads (OpenMP, MKL) for this thread and threads started later; its
    inter-op pool no larger, where it is not started yet (torch allows that once per process,
    before any inter-op work). Returns the count torch reports back."""
    import torch

    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() > threads:
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # already set or started in this process: it stays as it is
            logger.debug("torch inter-op threads stay at %d", torch.get_num_interop_threads())
    return torch.get_num_threads()


# ---- the kernel's files --------------------------------------------------------------------


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def physical_cores(cpus: Iterable[int], cpu_dir: Path) -> int:
    """Distinct physical cores among `cpus`: SMT siblings (hyperthreads) of one core count once.
    A CPU whose topology cannot be read counts as a core of its own."""
    cores = set()
    for cpu in cpus:
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        siblings = _read(topology / "thread_siblings_list") or _read(topology / "core_cpus_list")
        if siblings:
            try:
                cores.add(("siblings", min(parse_cpu_list(siblings))))
                continue
            except ValueError:
                pass
        core_id = _read(topology / "core_id")
        package = _read(topology / "physical_package_id") or "0"
        cores.add(("core", package, core_id) if core_id else ("cpu", cpu))
    return len(cores)


def cgroup_quota(paths: SysPaths) -> float | None:
    """The CPU quota (in CPUs) of the process's cgroup and its parents, the smallest; None when
    there is none or no cgroup file can be read."""
    quotas = [q for d in _cgroup_dirs(paths) if (q := _quota_in(d)) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(paths: SysPaths) -> list[Path]:
    """The process's CPU cgroup directory and its parents up to the mount, v2 and v1."""
    v2_rel = v1_rel = None
    for line in (_read(paths.proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2_rel = rel
        elif "cpu" in controllers.split(","):
            v1_rel = rel
    root = paths.cgroup_root
    mounts: list[tuple[Path, str | None]] = [(root, v2_rel)]
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        mounts.append((root / name, v1_rel))
    dirs: list[Path] = []
    for mount, rel in mounts:
        if not mount.is_dir():
            continue
        here = mount / (rel or "/").lstrip("/")
        # Inside a container's cgroup namespace the path can name the host's hierarchy: then
        # the mount itself is the process's cgroup.
        here = here if here.is_dir() else mount
        while True:
            dirs.append(here)
            if here == mount or mount not in here.parents:
                break
            here = here.parent
    return dirs


def _quota_in(cgroup: Path) -> float | None:
    if (cpu_max := _read(cgroup / "cpu.max")) is not None:  # v2: "QUOTA PERIOD" or "max PERIOD"
        fields = cpu_max.split()
        if len(fields) == 2 and fields[0] != "max":
            return _ratio(fields[0], fields[1])
        return None
    quota = _read(cgroup / "cpu.cfs_quota_us")  # v1: -1 is no quota
    period = _read(cgroup / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _omp_num_threads(value: str | None) -> int | None:
    """OMP_NUM_THREADS's first level ('4' or '4,2'); None when unset or not a positive count."""
    if not value:
        return None
    try:
        n = int(value.split(",")[0])
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        logger.warning(
            "OMP_NUM_THREADS=%r is not a thread count (1-%d); ignored", value, MAX_THREADS
        )
        return None
    return n
