"""Each worker's memory budget and pixel share, from `--memory_budget_bytes` and `--max_inflight_pixels`.

Given, they are checked against each other; left at 0, the budget is derived from what the host's memory leaves
(serving/host/memory.py): estimated at start where there is no cgroup limit, else measured by the workers once
their models have loaded. The flags check it at start, the master logs an estimate, each worker resolves its own.
"""
from __future__ import annotations

from collections.abc import Callable

from serving.host.cpus import CGROUP_ROOT
from serving.host.memory import (
    Footprint,
    available_memory,
    cgroup_memory,
    default_memory_budget,
    estimated_footprint,
    footprint_after_load,
    log_budget,
)
from serving.memory_costs import BODY_BYTES_FACTOR, BYTES_PER_PIXEL
from serving.options.config import ServerOptions


def default_pixel_share(budget: int, max_image_pixels: int) -> int:
    """Decoded pixels a worker's TF calls may hold at once: half its budget, never less than one largest image."""
    return max(budget // 2 // BYTES_PER_PIXEL, max_image_pixels)


def resolve_memory_budget(options: ServerOptions, footprint: Footprint | None = None) -> tuple[int, int]:
    """Each worker's memory budget and its pixel share, (bytes, pixels): as the flags give them, else derived
    from `footprint` (default: estimated from this machine's memory limit); (-1, -1) when
    either flag turns the budget off. ValueError for flags that contradict each other."""
    d = options.dataplane
    if d.memory_budget_bytes < 0 or d.max_inflight_pixels < 0:
        return -1, -1
    if 0 < d.max_inflight_pixels < d.max_image_pixels:
        raise ValueError("--max_inflight_pixels must be at least --max_image_pixels, or one allowed image could "
                         "never run")
    budget = d.memory_budget_bytes
    if budget == 0:
        pixels = max(d.max_inflight_pixels, d.max_image_pixels)
        floor = pixels * BYTES_PER_PIXEL + options.protocols.max_request_bytes * BODY_BYTES_FACTOR
        workers = options.process.workers
        budget = default_memory_budget(footprint or estimated_footprint(available_memory(), workers), workers, floor)
    pixels = d.max_inflight_pixels or default_pixel_share(budget, d.max_image_pixels)
    if pixels * BYTES_PER_PIXEL >= budget:
        raise ValueError(f"--memory_budget_bytes ({budget}) must be larger than the decoded pixels it keeps "
                         f"(--max_inflight_pixels {pixels}, {BYTES_PER_PIXEL} bytes each), to leave room for "
                         "request bodies")
    return budget, pixels


def measures_memory_budget(options: ServerOptions, cgroup_root: str = CGROUP_ROOT) -> bool:
    """Whether the budget is derived from what the server's cgroup holds once its models have loaded (see
    `budget_after_load`): when it is derived at all, and there is a cgroup limit to read."""
    d = options.dataplane
    if d.memory_budget_bytes != 0 or d.max_inflight_pixels < 0:
        return False
    cgroup = cgroup_memory(cgroup_root)
    return cgroup is not None and cgroup.limit is not None


def log_estimated_budget(options: ServerOptions) -> None:
    """The master's line at start for a budget derived where there is no cgroup limit to measure (a measured one is
    logged by the worker that measured it, `budget_after_load`)."""
    d, workers = options.dataplane, options.process.workers
    if d.memory_budget_bytes == 0 and d.max_inflight_pixels >= 0 and not measures_memory_budget(options):
        footprint = estimated_footprint(available_memory(), workers)
        log_budget(footprint, workers, *resolve_memory_budget(options, footprint))


def budget_after_load(options: ServerOptions, pooled: Callable[[], int] = lambda: 0,
                      cgroup_root: str = CGROUP_ROOT) -> tuple[int, int]:
    """The budget and pixel share from the cgroup's reading once every worker has loaded and warmed up its models
    (a worker calls it then, before it admits a request, with `pooled` reading what its tensor pool holds free);
    logged by the worker that read it. Without a cgroup limit to read, the estimate's."""
    workers = options.process.workers
    measured = footprint_after_load(workers, options.process.reload_dir, cgroup_root, pooled())
    footprint = estimated_footprint(available_memory(cgroup_root), workers) if measured is None else measured[0]
    budget, pixels = resolve_memory_budget(options, footprint)
    if measured is None or measured[1]:
        log_budget(footprint, workers, budget, pixels)
    return budget, pixels
