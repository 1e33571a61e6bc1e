"""The memory limit a worker sizes its memory budget by (the cgroup's, else physical memory), and the budget it
derives."""
from serving.memory import (
    BYTES_PER_PIXEL,
    ESTIMATE_SLACK,
    HEADROOM,
    IDLE_WORKER_BYTES,
    MASTER_BYTES,
    MAX_DEFAULT_BUDGET,
    GiB,
    MiB,
    available_memory,
    default_memory_budget,
    default_pixel_share,
)


def test_cgroup_v2_and_v1_limits_and_none(tmp_path):
    (tmp_path / "memory.max").write_text(f"{2 * GiB}\n")
    assert available_memory(str(tmp_path)) == 2 * GiB
    (tmp_path / "memory.max").write_text("max\n")
    physical = available_memory(str(tmp_path))
    assert physical > 256 * 1024 * 1024  # no limit: the machine's memory
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{GiB}\n")
    assert available_memory(str(tmp_path)) == GiB
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert available_memory(str(tmp_path)) == physical


def group_peak(memory: int, workers: int) -> float:
    """The worst the process group can reach under the derived budget: the master, and each worker idle plus its
    budget and the estimate's slack."""
    return MASTER_BYTES + workers * (IDLE_WORKER_BYTES + default_memory_budget(memory, workers, 0) *
                                     (1 + ESTIMATE_SLACK))


def test_default_budget_keeps_the_process_group_within_85_percent_of_the_limit():
    for memory, workers in ((2 * GiB, 1), (4 * GiB, 2), (3 * GiB, 3), (8 * GiB, 4)):
        budget = default_memory_budget(memory, workers, 0)
        assert 0 < budget < MAX_DEFAULT_BUDGET
        assert group_peak(memory, workers) <= (1 - HEADROOM) * memory
        assert group_peak(memory, workers) > (1 - HEADROOM) * memory - workers * MiB  # and uses what it may
    assert default_memory_budget(2 * GiB, 1, 0) > 800 * MiB  # the shipped pod: 849 MiB
    assert default_memory_budget(64 * GiB, 1, 0) == MAX_DEFAULT_BUDGET  # no limit but a large machine's


def test_default_budget_never_falls_below_one_largest_request():
    floor = 300 * MiB
    assert default_memory_budget(2 * GiB, 4, floor) == floor  # four idle workers do not fit: the floor stands
    assert default_memory_budget(GiB // 2, 1, floor) == floor


def test_default_pixel_share_is_half_the_budget_at_least_one_largest_image():
    assert default_pixel_share(GiB, 40_000_000) == GiB // 2 // BYTES_PER_PIXEL
    assert default_pixel_share(256 * MiB, 40_000_000) == 40_000_000
