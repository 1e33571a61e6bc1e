"""The memory limit a worker sizes its pixel budget by: the cgroup's, else physical memory."""
from serving.memory import BYTES_PER_PIXEL, GiB, available_memory, default_pixel_budget


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


def test_default_budget_is_half_the_memory_over_the_workers_at_most_a_gib_each():
    assert default_pixel_budget(2 * GiB, 1, 40_000_000) == GiB // BYTES_PER_PIXEL
    assert default_pixel_budget(64 * GiB, 1, 40_000_000) == GiB // BYTES_PER_PIXEL
    assert default_pixel_budget(2 * GiB, 4, 40_000_000) == 2 * GiB // 8 // BYTES_PER_PIXEL
    # never below one largest allowed image, which could otherwise never run
    assert default_pixel_budget(GiB // 4, 2, 40_000_000) == 40_000_000
