"""How many cores this process may use: what every thread-pool default is sized by.

`os.cpu_count()` counts the host. In a container limited to 2 CPUs on a 64-core node it would start 64 batch
threads, each with a TensorFlow pool, all throttled by the quota. The affinity mask and the cgroup CPU quota
(v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) say what is really there.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"


def available_cores(cgroup_root: str = CGROUP_ROOT) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def cgroup_cpu_quota(root: str = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup quota, or None when there is none (or no cgroup filesystem to read)."""
    try:
        limit, interval = Path(root, "cpu.max").read_text().split()
        return None if limit == "max" else int(limit) / int(interval)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 else None
