"""The memory limit a worker sizes its memory budget by (the cgroup's, else physical memory), what the cgroup holds
(v1 and v2 files, as a container sees its own), and the budget derived from it."""
import json
import logging
import os
import subprocess
import threading

import pytest

from serving.host.memory import (
    ESTIMATE_SLACK,
    HEADROOM,
    MAX_DEFAULT_BUDGET,
    CgroupMemory,
    GiB,
    MiB,
    available_memory,
    cgroup_memory,
    default_memory_budget,
    estimated_footprint,
    fits,
    footprint_after_load,
    measured_footprint,
)
from serving.memory_costs import BYTES_PER_PIXEL
from serving.options.config import ProcessOptions, ServerOptions
from serving.process.memory_budget import budget_after_load, default_pixel_share, measures_memory_budget


def test_cgroup_v2_and_v1_limits_and_none(tmp_path):
    (tmp_path / "memory.max").write_text(f"{2 * GiB}\n")
    assert available_memory(str(tmp_path)) == 2 * GiB
    (tmp_path / "memory.max").write_text("max\n")
    physical = available_memory(str(tmp_path))
    assert physical == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # no limit: the machine's memory
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{GiB}\n")
    assert available_memory(str(tmp_path)) == GiB
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert available_memory(str(tmp_path)) == physical


def cgroup_v2(root, limit: str = str(2 * GiB), usage: int = 1100 * MiB) -> None:
    """A v2 container's /sys/fs/cgroup, as the kernel writes its files (the keys read among others)."""
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{usage}\n")
    (root / "memory.stat").write_text(f"anon {250 * MiB}\nfile {820 * MiB}\nkernel {30 * MiB}\n"
                                      f"active_file {40 * MiB}\ninactive_file {780 * MiB}\n")
    (root / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n")


def cgroup_v1(root, limit: str = str(2 * GiB), usage: int = 1100 * MiB) -> None:
    """A v1 container's /sys/fs/cgroup/memory: its own figures and, with total_, its descendants' too."""
    folder = root / "memory"
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text(limit + "\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"cache {800 * MiB}\nrss {250 * MiB}\ninactive_file {770 * MiB}\n"
                                        f"total_cache {820 * MiB}\ntotal_rss {250 * MiB}\n"
                                        f"total_inactive_file {780 * MiB}\ntotal_active_file {40 * MiB}\n")
    (folder / "memory.failcnt").write_text("7\n")
    (folder / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")


@pytest.mark.parametrize("version,write", [(2, cgroup_v2), (1, cgroup_v1)])
def test_what_the_cgroup_holds_is_read_from_v2_and_v1_files(tmp_path, version, write):
    write(tmp_path)
    assert cgroup_memory(str(tmp_path)) == CgroupMemory(
        version=version, limit=2 * GiB, usage=1100 * MiB, working_set=(1100 - 780) * MiB, file=820 * MiB,
        failed_charges=7, oom_kills=1)


def test_no_cgroup_or_no_limit(tmp_path):
    assert cgroup_memory(str(tmp_path)) is None
    cgroup_v2(tmp_path, limit="max")
    assert cgroup_memory(str(tmp_path)).limit is None
    with pytest.raises(ValueError):
        measured_footprint(cgroup_memory(str(tmp_path)))


def peak(footprint, workers: int) -> float:
    """The worst the server can reach under the derived budget: its footprint, and each worker's budget with the
    estimate's slack."""
    return footprint.held + workers * default_memory_budget(footprint, workers, 0) * (1 + ESTIMATE_SLACK)


def test_a_measured_budget_keeps_the_cgroup_and_its_page_cache_within_85_percent_of_the_limit(tmp_path):
    cgroup_v1(tmp_path)
    footprint = measured_footprint(cgroup_memory(str(tmp_path)))
    assert footprint.held == 1100 * MiB, "the page cache it was charged for counts, not only its processes"
    for workers in (1, 2, 3):
        assert peak(footprint, workers) <= (1 - HEADROOM) * footprint.limit
        assert peak(footprint, workers) > (1 - HEADROOM) * footprint.limit - workers * MiB  # and uses what it may
    assert default_memory_budget(footprint, 1, 0) == int((0.85 * 2048 - 1100) / 1.15 * MiB)


def test_without_a_cgroup_the_budget_is_the_estimate_of_the_idle_server():
    for memory, workers in ((2 * GiB, 1), (4 * GiB, 2), (3 * GiB, 3), (8 * GiB, 4)):
        footprint = estimated_footprint(memory, workers)
        assert 0 < default_memory_budget(footprint, workers, 0) < MAX_DEFAULT_BUDGET
        assert peak(footprint, workers) <= (1 - HEADROOM) * memory
    assert default_memory_budget(estimated_footprint(64 * GiB, 1), 1, 0) == MAX_DEFAULT_BUDGET


def test_default_budget_never_falls_below_one_largest_request():
    floor = 300 * MiB
    small = estimated_footprint(2 * GiB, 4)
    assert default_memory_budget(small, 4, floor) == floor  # four idle workers do not fit: the floor stands
    assert not fits(small, 4, floor)  # and the line at start says so
    assert default_memory_budget(estimated_footprint(GiB // 2, 1), 1, floor) == floor
    roomy = estimated_footprint(4 * GiB, 1)
    assert fits(roomy, 1, default_memory_budget(roomy, 1, floor))


def test_default_pixel_share_is_half_the_budget_at_least_one_largest_image():
    assert default_pixel_share(GiB, 40_000_000) == GiB // 2 // BYTES_PER_PIXEL
    assert default_pixel_share(256 * MiB, 40_000_000) == 40_000_000


# --- measured once the workers have loaded ----------------------------------------------------------------------

def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_lone_worker_reads_its_cgroup_at_once(tmp_path):
    cgroup_v2(tmp_path)
    footprint, read_here = footprint_after_load(1, None, str(tmp_path))
    assert (footprint.held, read_here) == (1100 * MiB, True)
    assert footprint_after_load(1, None, str(tmp_path / "none")) is None
    footprint, _ = footprint_after_load(1, None, str(tmp_path), pooled=100 * MiB)
    assert (footprint.held, footprint.pooled) == (1000 * MiB, 100 * MiB), "its tensor pool's free bytes are left out"


def test_several_workers_read_it_once_all_have_loaded_and_later_ones_take_what_was_published(tmp_path):
    root, shared = tmp_path / "cgroup", tmp_path / "shared"
    root.mkdir()
    shared.mkdir()
    cgroup_v2(root)
    (shared / "memory").mkdir()
    (shared / "memory" / f"loaded.{dead_pid()}").touch()  # a worker that died loading counts for nothing
    done: list = []
    first = threading.Thread(target=lambda: done.append(footprint_after_load(2, str(shared), str(root), 30 * MiB)))
    first.start()
    first.join(0.5)
    assert not done, "it waits for its sibling"
    sibling = subprocess.Popen(["sleep", "30"])
    try:
        (shared / "memory" / f"loaded.{sibling.pid}").write_text(str(20 * MiB))  # its tensor pool's free bytes
        first.join(10)
        assert done and done[0][0].held == 1050 * MiB and done[0][1], "both pools' free bytes are left out"
        cgroup_v2(root, usage=1900 * MiB)  # later, requests in flight: a replacement worker must not read this
        footprint, read_here = footprint_after_load(2, str(shared), str(root))
        assert (footprint.held, footprint.pooled, read_here) == (1050 * MiB, 50 * MiB, False)
        assert json.loads((shared / "memory" / "footprint.json").read_text())["cgroup"]["usage"] == 1100 * MiB
    finally:
        sibling.kill()
        sibling.wait()


def test_the_budget_after_load_is_measured_and_logged_in_one_line(tmp_path, caplog):
    cgroup_v1(tmp_path)
    options = ServerOptions(process=ProcessOptions(workers=1))
    assert measures_memory_budget(options, str(tmp_path))
    assert not measures_memory_budget(options, str(tmp_path / "none"))  # no cgroup: the estimate, known at once
    caplog.set_level(logging.INFO, logger="serving.host.memory")
    budget, pixels = budget_after_load(options, lambda: 64 * MiB, cgroup_root=str(tmp_path))
    assert budget == default_memory_budget(measured_footprint(cgroup_memory(str(tmp_path)), 64 * MiB), 1, 0)
    assert pixels == default_pixel_share(budget, options.dataplane.max_image_pixels)
    [line] = [r for r in caplog.records if r.getMessage() == "memory budget"]
    assert line.fields == {"source": "cgroup v1", "limit_bytes": 2 * GiB, "held_bytes": 1036 * MiB,
                           "working_set_bytes": 320 * MiB, "file_bytes": 820 * MiB, "failed_charges": 7,
                           "pooled_bytes": 64 * MiB, "workers": 1, "memory_budget_bytes": budget,
                           "max_inflight_pixels": pixels}
    assert line.levelno == logging.INFO
