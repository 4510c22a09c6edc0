"""The hf engine's automatic thread count: affinity and cgroup quotas (v1 and v2)."""

from __future__ import annotations

import os

from kvmesh.engines.hf.cpus import auto_threads, cgroup_cpus, parse_cfs, parse_cpu_max, threads_for


def test_cpu_max_and_cfs_lines_parse():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("garbage") is None
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("50000\n", "100000\n") == 0.5


def test_threads_are_the_tighter_of_affinity_and_quota():
    assert threads_for(8, None) == 8
    assert threads_for(8, 2.0) == 2
    assert threads_for(8, 2.7) == 2  # a partial CPU is no thread's worth
    assert threads_for(2, 16.0) == 2
    assert threads_for(4, 0.5) == 1  # never below one


def test_v2_quota_of_an_ancestor_cgroup_bounds_the_process(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    parent = tmp_path / "kubepods" / "pod1"
    own = parent / "ctr"
    own.mkdir(parents=True)
    (parent / "cpu.max").write_text("300000 100000\n")
    (own / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_cpus(tmp_path, proc) == 3.0


def test_v1_quota_is_read_and_no_quota_means_none(tmp_path):
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:cpu,cpuacct:/\n")
    assert cgroup_cpus(tmp_path, proc) is None
    v1 = tmp_path / "cpu,cpuacct"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpus(tmp_path, proc) == 1.0


def test_auto_threads_fits_this_process():
    n = auto_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
