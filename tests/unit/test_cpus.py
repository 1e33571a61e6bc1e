"""Thread pools are sized by the cores this process may use, and split between the model's callers."""
from __future__ import annotations

import os

import pytest

from serving.host.cpus import available_cores, cgroup_cpu_quota
from serving.options.config import BatchingOptions, DataPlaneOptions, ProcessOptions, ServerOptions
from serving.process.tensorflow_runtime import intra_op_threads


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize("cpu_max,quota", [("max 100000\n", None), ("200000 100000\n", 2.0),
                                           ("150000 100000\n", 1.5), ("50000 100000\n", 0.5)])
def test_cgroup_v2_quota(tmp_path, cpu_max, quota):
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert cgroup_cpu_quota(str(tmp_path)) == quota


@pytest.mark.parametrize("quota_us,quota", [("-1", None), ("300000", 3.0), ("25000", 0.25)])
def test_cgroup_v1_quota(tmp_path, quota_us, quota):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota_us + "\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == quota


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path)) is None
    assert available_cores(str(tmp_path)) == host_cores()


def test_a_quota_caps_the_cores_and_a_fraction_rounds_up(tmp_path):
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert available_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text(f"{(host_cores() + 8) * 100000} 100000\n")
    assert available_cores(str(tmp_path)) == host_cores(), "a quota above the host's cores changes nothing"


def options(workers: int = 1, **dataplane) -> ServerOptions:
    return ServerOptions(DataPlaneOptions(**dataplane), process=ProcessOptions(workers=workers))


def test_intra_op_threads_split_the_cores_between_batch_threads_and_workers():
    two_threads = BatchingOptions(num_batch_threads=2)
    assert intra_op_threads(options(batching=two_threads), cores=2) == 1
    assert intra_op_threads(options(batching=two_threads), cores=16) == 8
    assert intra_op_threads(options(batching=two_threads, workers=2), cores=16) == 4
    assert intra_op_threads(options(batching=BatchingOptions(num_batch_threads=32)), cores=16) == 1


def test_without_batching_each_worker_is_one_caller():
    assert intra_op_threads(options(enable_batching=False), cores=16) == 16
    assert intra_op_threads(options(enable_batching=False, workers=4), cores=16) == 4


def test_the_flag_wins():
    assert intra_op_threads(options(tensorflow_intra_op_parallelism=3), cores=16) == 3
