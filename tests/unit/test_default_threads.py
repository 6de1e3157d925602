"""The default thread count: one per physical core the process may use, within a container's CPU quota."""

from __future__ import annotations

import os

from speedc.runtimes.backends.protocol import default_threads, resolve_threads


def write_topology(sysfs, cores: dict[int, tuple[int, int]]) -> None:
    """CPU number -> (package, core), as Linux's /sys/devices/system/cpu/cpuN/topology shows it."""
    for cpu, (package, core) in cores.items():
        folder = sysfs / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")


def test_smt_siblings_count_once_and_the_quota_caps(tmp_path):
    sysfs, cgroup = tmp_path / "cpu", tmp_path / "cgroup"
    cgroup.mkdir()
    # 2 packages x 2 cores x 2 hardware threads: cpu N and N + 4 are siblings
    write_topology(sysfs, {cpu: (cpu // 2 % 2, cpu % 2) for cpu in range(8)})
    assert default_threads(set(range(8)), sysfs, cgroup) == 4
    assert default_threads({0, 4}, sysfs, cgroup) == 1  # taskset to one core's two threads
    assert default_threads({0, 1, 2}, sysfs, cgroup) == 3
    (cgroup / "cpu.max").write_text("250000 100000\n")  # a container allowed 2.5 CPUs
    assert default_threads(set(range(8)), sysfs, cgroup) == 3
    (cgroup / "cpu.max").write_text("max 100000\n")
    assert default_threads(set(range(8)), sysfs, cgroup) == 4
    assert default_threads({0, 9}, sysfs, cgroup) == 2  # no topology for cpu9: a core of its own


def test_this_host_and_the_setting_that_overrides_it(monkeypatch):
    here = default_threads()
    assert 1 <= here <= len(os.sched_getaffinity(0))
    monkeypatch.delenv("SPEEDC_THREADS", raising=False)
    assert resolve_threads(None) == here and resolve_threads(3) == 3
    monkeypatch.setenv("SPEEDC_THREADS", "5")
    assert resolve_threads(None) == 5
