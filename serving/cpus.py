"""How many cores this process may use: what every thread-pool default is sized by.

`os.cpu_count()` counts the host. In a container limited to 2 CPUs on a 64-core node it would start 64 batch
threads, each with a TensorFlow pool, all throttled by the quota. The affinity mask and the cgroup CPU quota
(v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) say what is really there.
"""
from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"


def available_cores(cgroup_root: str = CGROUP_ROOT) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def cgroup_cpu_quota(root: str = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup quota, or None when there is none (or no cgroup filesystem to read)."""
    v2 = _read(os.path.join(root, "cpu.max")).split()
    if len(v2) == 2:
        return None if v2[0] == "max" else int(v2[0]) / int(v2[1])
    quota = _read(os.path.join(root, "cpu", "cpu.cfs_quota_us")).strip()
    period = _read(os.path.join(root, "cpu", "cpu.cfs_period_us")).strip()
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
