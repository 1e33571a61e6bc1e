"""How much memory this process may use, and from it the default memory budget of each worker.

The budget (serving/core/budget.py) covers what requests in flight hold: their bodies, and the images being
decoded, which a JPEG makes large (a 6000 x 6000 flat colour: 0.56 MB sent, 108 MB decoded). The limit is the
cgroup's (v2 `memory.max`, v1 `memory.limit_in_bytes`) when there is one, else the machine's physical memory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from serving.cpus import CGROUP_ROOT

GiB = 1 << 30
MiB = 1 << 20
# Decoding holds the uint8 RGB image (3 bytes a pixel) and the decoder's working rows; the resize writes only the
# model's small input, and the model's per-batch tensors are smaller than that input. 4 bytes a pixel covers all
# of it, measured with benchmarks/memory.py.
BYTES_PER_PIXEL = 4
# What a request body costs while it is served, for each byte received: the bytes, a second copy while they are
# read or parsed (werkzeug joins the pieces read; JSON is parsed from text; gRPC hands over the serialized message),
# the parsed strings or deserialized message, and the decoded inputs (3-4x measured with benchmarks/memory.py over
# base64 JSON, V2 binary and gRPC, with one image decoding). A JSON number costs more than its few bytes:
# JSON_VALUE_BYTES for each value outside strings (a Python float and its list slot, then numpy's float64 array and
# the signature's dtype: 25-70 bytes a value measured, whatever its digits).
BODY_BYTES_FACTOR = 4
JSON_VALUE_BYTES = 64
# A worker's resident memory with the default model, idle (measured with benchmarks/memory.py: 631-655 MB), and
# the gunicorn master's.
IDLE_WORKER_BYTES = 700 * MiB
MASTER_BYTES = 64 * MiB
# The process group stays within 85% of the limit; and what a worker holds may exceed its budget's estimate by up
# to 15% (allocator slack, Python's per-object overhead), measured with benchmarks/memory.py.
HEADROOM = 0.15
ESTIMATE_SLACK = 0.15
# More than this per worker buys no throughput (the CPUs, not memory, bound a worker past it) and on a machine
# without a cgroup limit would let one worker take memory other processes need.
MAX_DEFAULT_BUDGET = 2 * GiB


@dataclass(frozen=True)
class CgroupMemory:
    """What a memory cgroup holds, in bytes, as its own files report it (docs/security.md#memory-budget)."""
    version: int  # 1 or 2
    limit: int | None  # None: no limit
    usage: int  # everything charged to it: its processes' memory, the page cache they read, kernel memory
    working_set: int  # usage less the inactive file pages: what Kubernetes judges a pod by
    file: int  # page cache charged to it: shared libraries, the model, Python's modules
    failed_charges: int  # times the usage reached the limit (v1 memory.failcnt, v2 memory.events `max`)
    oom_kills: int


def _stat(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file (memory.stat, memory.events, memory.oom_control) as a dict."""
    return {key: int(value) for key, value in (line.split() for line in path.read_text().splitlines() if line)}


def _limit(text: str) -> int | None:
    """v2 says "max" for no limit, v1 a number near 2**63."""
    text = text.strip()
    return int(text) if text.isdigit() and int(text) < (1 << 60) else None


def read_cgroup_v2(folder: str | Path) -> CgroupMemory:
    """A v2 cgroup's memory (OSError or ValueError when its files are not there)."""
    folder = Path(folder)
    stat, events = _stat(folder / "memory.stat"), _stat(folder / "memory.events")
    usage = int((folder / "memory.current").read_text())
    return CgroupMemory(2, _limit((folder / "memory.max").read_text()), usage,
                        max(0, usage - stat["inactive_file"]), stat["file"], events["max"], events["oom_kill"])


def read_cgroup_v1(folder: str | Path) -> CgroupMemory:
    """A v1 memory cgroup's memory, counting its descendants as v2 does (OSError or ValueError when its files are
    not there)."""
    folder = Path(folder)
    stat = _stat(folder / "memory.stat")
    usage = int((folder / "memory.usage_in_bytes").read_text())
    return CgroupMemory(1, _limit((folder / "memory.limit_in_bytes").read_text()), usage,
                        max(0, usage - stat["total_inactive_file"]), stat["total_cache"],
                        int((folder / "memory.failcnt").read_text()),
                        _stat(folder / "memory.oom_control").get("oom_kill", 0))


def cgroup_memory(cgroup_root: str = CGROUP_ROOT) -> CgroupMemory | None:
    """This process's memory cgroup, as a container sees its own (v2 at the root, v1 under `memory/`); None when
    there is none to read."""
    for read, folder in ((read_cgroup_v2, Path(cgroup_root)), (read_cgroup_v1, Path(cgroup_root, "memory"))):
        try:
            return read(folder)
        except (OSError, ValueError, KeyError):
            continue
    return None


def available_memory(cgroup_root: str = CGROUP_ROOT) -> int:
    """Bytes this process may use: the cgroup limit when set, else physical memory."""
    for path in (Path(cgroup_root, "memory.max"), Path(cgroup_root, "memory", "memory.limit_in_bytes")):
        try:
            limit = _limit(path.read_text())
        except OSError:
            continue
        if limit is not None:
            return limit
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget(memory: int, workers: int, floor: int) -> int:
    """Bytes one worker may hold for requests: the limit less the headroom, the master and the idle workers, over
    the workers and the estimate's slack; never less than `floor` (what one largest request needs)."""
    usable = memory * (1 - HEADROOM) - MASTER_BYTES - workers * IDLE_WORKER_BYTES
    per_worker = int(usable / max(1, workers) / (1 + ESTIMATE_SLACK))
    return max(min(per_worker, MAX_DEFAULT_BUDGET), floor)


def default_pixel_share(budget: int, max_image_pixels: int) -> int:
    """Decoded pixels a worker's TF calls may hold at once: half its budget, never less than one largest image."""
    return max(budget // 2 // BYTES_PER_PIXEL, max_image_pixels)
