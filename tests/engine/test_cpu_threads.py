"""engine/cpu_threads.py against fake sysfs and cgroup trees: affinity, SMT siblings, cgroup v1
and v2 quotas (nested, namespaced), OMP_NUM_THREADS, and what the engine applies."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu_threads import (
    CpuBudget,
    SysPaths,
    cgroup_quota,
    check_threads,
    choose_threads,
    configure_threads,
    cpu_list,
    detect_budget,
    parse_cpu_list,
    physical_cores,
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _topology(cpu_dir: Path, siblings: dict[int, str]) -> Path:
    """cpuN/topology/thread_siblings_list for each CPU."""
    for cpu, text in siblings.items():
        _write(cpu_dir / f"cpu{cpu}" / "topology" / "thread_siblings_list", text)
    return cpu_dir


def _paths(tmp_path: Path, proc_cgroup: str = "0::/\n") -> SysPaths:
    paths = SysPaths(tmp_path / "cpu", tmp_path / "cgroup", tmp_path / "proc_self_cgroup")
    paths.cgroup_root.mkdir(parents=True, exist_ok=True)
    paths.cpu_dir.mkdir(parents=True, exist_ok=True)
    _write(paths.proc_cgroup, proc_cgroup)
    return paths


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    assert cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert cpu_list([4]) == "4"


def test_smt_siblings_count_once(tmp_path):
    # 4 logical CPUs on 2 cores, numbered as Linux does on x86: 0/2 and 1/3 share a core.
    cpu_dir = _topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert physical_cores([0, 1, 2, 3], cpu_dir) == 2
    assert physical_cores([0, 2], cpu_dir) == 1  # taskset on one core's two hyperthreads
    assert physical_cores([0, 1], cpu_dir) == 2
    # Ranges as well as lists (AMD numbers siblings next to each other).
    cpu_dir = _topology(tmp_path / "amd", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert physical_cores([0, 1, 2], cpu_dir) == 2


def test_core_id_when_no_siblings_list(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (1, 0), (1, 0)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        _write(topology / "core_id", str(core))
        _write(topology / "physical_package_id", str(package))
    # core_id 0 on two sockets is two cores.
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 1], tmp_path) == 1


def test_unreadable_topology_counts_each_cpu(tmp_path):
    assert physical_cores([0, 1, 5], tmp_path) == 3


def test_cgroup_v2_quota_of_the_process_and_its_parents(tmp_path):
    paths = _paths(tmp_path, "0::/system.slice/nightshift.service\n")
    root = paths.cgroup_root
    _write(root / "cgroup.controllers", "cpuset cpu io memory pids")
    _write(root / "system.slice" / "cpu.max", "max 100000")
    _write(root / "system.slice" / "nightshift.service" / "cpu.max", "150000 100000")
    assert cgroup_quota(paths) == 1.5
    # A parent's smaller quota binds the child too.
    _write(root / "system.slice" / "cpu.max", "100000 100000")
    assert cgroup_quota(paths) == 1.0
    _write(root / "system.slice" / "cpu.max", "max 100000")
    _write(root / "system.slice" / "nightshift.service" / "cpu.max", "max 100000")
    assert cgroup_quota(paths) is None


def test_cgroup_v2_inside_a_container_namespace(tmp_path):
    # docker --cpus 2: the container's own cgroup is mounted at /sys/fs/cgroup and
    # /proc/self/cgroup says "0::/" (or names a host path that does not exist in here).
    for i, proc in enumerate(["0::/\n", "0::/docker/0123abcd\n"]):
        paths = _paths(tmp_path / str(i), proc)
        _write(paths.cgroup_root / "cpu.max", "200000 100000")
        assert cgroup_quota(paths) == 2.0


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    paths = _paths(tmp_path, proc)
    cpu = paths.cgroup_root / "cpu,cpuacct"
    _write(cpu / "cpu.cfs_quota_us", "-1")
    _write(cpu / "cpu.cfs_period_us", "100000")
    _write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "50000")
    _write(cpu / "docker" / "abc" / "cpu.cfs_period_us", "100000")
    assert cgroup_quota(paths) == 0.5
    _write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "-1")
    assert cgroup_quota(paths) is None
    # A hybrid host (v1 controllers, an empty unified tree) and no /proc file at all: no quota.
    assert cgroup_quota(SysPaths(tmp_path / "none", tmp_path / "none", tmp_path / "none")) is None


def test_the_budget_is_the_smallest_limit(tmp_path):
    paths = _paths(tmp_path, "0::/job\n")
    _topology(paths.cpu_dir, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})  # 4 cores x 2 SMT
    _write(paths.cgroup_root / "job" / "cpu.max", "max 100000")
    budget = detect_budget(paths, affinity=range(8))
    assert (budget.physical_cores, budget.quota, budget.threads) == (4, None, 4)
    assert detect_budget(paths, affinity=[0, 4, 1]).threads == 2  # affinity: 3 CPUs, 2 cores
    _write(paths.cgroup_root / "job" / "cpu.max", "250000 100000")
    budget = detect_budget(paths, affinity=range(8))
    assert budget.threads == 2  # 2.5 CPUs of quota: 2 threads that never wait for the third
    assert budget.describe() == (
        "physical cores available: affinity 0-7 (4 cores), cgroup quota 2.5"
    )
    _write(paths.cgroup_root / "job" / "cpu.max", "50000 100000")
    assert detect_budget(paths, affinity=range(8)).threads == 1  # half a CPU: still one


def test_choice_order_requested_then_omp_then_cores():
    budget = CpuBudget(cpus=(0, 1, 2, 3), physical_cores=2, quota=2.0)
    choice = choose_threads(None, environ={}, budget=budget)
    assert (choice.threads, choice.source) == (2, "available cores")
    assert choice.describe() == (
        "2 (physical cores available: affinity 0-3 (2 cores), cgroup quota 2.0)"
    )
    choice = choose_threads(None, environ={"OMP_NUM_THREADS": "1"}, budget=budget)
    assert (choice.threads, choice.source) == (1, "OMP_NUM_THREADS")
    choice = choose_threads(3, environ={"OMP_NUM_THREADS": "1"}, budget=budget)
    assert (choice.threads, choice.source, choice.above_budget) == (3, "--threads", True)
    assert choice.describe().startswith("3 (--threads; physical cores available: affinity 0-3")
    # Nested OMP lists take the outer level; nonsense is ignored.
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "4,2"}, budget=budget).threads == 4
    for bad in ("0", "abc", "-1"):
        assert choose_threads(None, environ={"OMP_NUM_THREADS": bad}, budget=budget).threads == 2


@pytest.mark.parametrize("bad", [0, -2])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match=f"^--threads must be at least 1, not {bad}$"):
        check_threads(bad)
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        choose_threads(bad)
    with pytest.raises(ValueError, match="num_threads must be at least 1"):
        EngineConfig(num_threads=bad).validate()
    assert check_threads(None) is None and check_threads(1) == 1


def test_configure_applies_logs_once_and_warns_above_the_cores(caplog, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    caplog.set_level(logging.INFO, logger="engine.cpu_threads")
    choice = configure_threads(1)
    assert torch.get_num_threads() == 1
    assert caplog.messages == [f"torch threads: 1 (--threads; {choice.budget.describe()})"]
    configure_threads(1)  # a second engine with the same count: no second line
    assert len(caplog.messages) == 1
    many = choice.budget.threads + 1
    configure_threads(many)
    assert torch.get_num_threads() == many
    assert "is more than the" in caplog.messages[-1]
    assert caplog.records[-1].levelno == logging.WARNING
    default = configure_threads(None)
    assert torch.get_num_threads() == default.threads == choice.budget.threads
    assert caplog.messages[-1] == f"torch threads: {default.threads} ({default.budget.describe()})"
