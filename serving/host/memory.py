"""How much memory this process may use, and the default memory budget of each worker that it leaves.

The budget (serving/core/budget.py) covers what requests in flight hold: their bodies, and the images being
decoded, which a JPEG makes large (a 6000 x 6000 flat colour: 0.56 MB sent, 108 MB decoded). It is what the limit
leaves once the headroom and the server's own footprint are taken off. In a cgroup with a limit (v2 `memory.max`,
v1 `memory.limit_in_bytes`: a container's) the footprint is measured once the models have loaded and warmed up:
everything the cgroup is charged for, its processes' memory and the page cache they read (TensorFlow's libraries,
the model, Python's modules), which a fresh pod is charged for as it reads them. Elsewhere the limit is the
machine's physical memory and the footprint is estimated from an idle server's measured size. What the flags ask
for is resolved against these figures in serving/process/memory_budget.py.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from serving.host.cpus import CGROUP_ROOT

GiB = 1 << 30
MiB = 1 << 20
# Without a cgroup to measure, the footprint is estimated: a worker's resident memory with the default model, idle
# (measured with benchmarks/memory.py: 631-655 MB), and the gunicorn master's.
IDLE_WORKER_BYTES = 700 * MiB
MASTER_BYTES = 64 * MiB
# The server, page cache included, stays within 85% of the limit; and what a worker holds may exceed its budget's
# estimate by up to 15% (allocator slack, Python's per-object overhead), measured with benchmarks/memory.py.
HEADROOM = 0.15
ESTIMATE_SLACK = 0.15
# A block of this size or more is a mapping of its own, returned to the system when freed (glibc's M_MMAP_THRESHOLD,
# through mallopt). glibc's default raises the threshold to each mapped block freed, up to 32 MiB, and keeps blocks
# under it in the arena of the thread that freed them: a decoder's buffers, freed by one of TensorFlow's threads,
# stayed there while the next image decoded on another thread took new ones, so the budget's requests were given
# back to it but not to the system (a flood of progressive JPEGs grew a worker by 282-343 MB over a 256 MiB
# budget that held at most 218 MB, flat JPEGs by up to 322 MB in CI; fixed at 1 MiB: 154-174 MB and 87-153 MB).
MMAP_THRESHOLD_BYTES = 1 * MiB
_M_MMAP_THRESHOLD = -3  # malloc.h
# TensorFlow's own pool (its BFC allocator) for its CPU tensors instead of malloc, read when its runtime starts.
TENSOR_POOL_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
# More than this per worker buys no throughput (the CPUs, not memory, bound a worker past it) and on a machine
# without a cgroup limit would let one worker take memory other processes need.
MAX_DEFAULT_BUDGET = 2 * GiB
SIBLINGS_POLL_S = 0.1

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Footprint:
    """What the whole server (master and workers) holds before any request, against the bytes it may use."""
    limit: int
    held: int
    cgroup: CgroupMemory | None = None  # the reading it was measured from; None: estimated from the constants
    pooled: int = 0  # of the reading, what the workers' tensor pools hold free: left out of `held` (`pool_tensors`)

    def fields(self) -> dict[str, object]:
        """For the log line that gives the budget."""
        if self.cgroup is None:
            return {"source": "estimate", "limit_bytes": self.limit, "held_bytes": self.held}
        c = self.cgroup
        return {"source": f"cgroup v{c.version}", "limit_bytes": self.limit, "held_bytes": self.held,
                "working_set_bytes": c.working_set, "file_bytes": c.file, "failed_charges": c.failed_charges,
                "pooled_bytes": self.pooled}


def estimated_footprint(memory: int, workers: int) -> Footprint:
    """Where there is no cgroup limit: `memory` (physical) less the master and the idle workers' measured size."""
    return Footprint(memory, MASTER_BYTES + workers * IDLE_WORKER_BYTES)


def measured_footprint(cgroup: CgroupMemory, pooled: int = 0) -> Footprint:
    """Everything the cgroup is charged for (its usage: the working set and every file page) against its limit:
    for the usage never to reach the limit, the page cache it holds, active or not, must fit under it too. Less
    `pooled`, what the workers' tensor pools hold free once the load has grown them (its batch cost's measure, its
    warmup): the requests the budget admits reuse those bytes before the pools grow again, so counting them in the
    footprint as well would count them twice."""
    if cgroup.limit is None:
        raise ValueError("a cgroup without a memory limit has no footprint to budget against")
    return Footprint(cgroup.limit, cgroup.usage - pooled, cgroup, pooled)


def default_memory_budget(footprint: Footprint, workers: int, floor: int) -> int:
    """Bytes one worker may hold for requests: the limit less the headroom and the footprint, over the workers and
    the estimate's slack; never less than `floor` (what one largest request needs)."""
    usable = footprint.limit * (1 - HEADROOM) - footprint.held
    per_worker = int(usable / max(1, workers) / (1 + ESTIMATE_SLACK))
    return max(min(per_worker, MAX_DEFAULT_BUDGET), floor)


def fits(footprint: Footprint, workers: int, budget: int) -> bool:
    """Whether the footprint and every worker's full budget (with the estimate's slack) stay within the limit less
    the headroom: false only when the floor (one largest request) lifted the budget past what is left."""
    return budget <= default_memory_budget(footprint, workers, 0)


def log_budget(footprint: Footprint, workers: int, budget: int, pixels: int) -> None:
    """The one line at start that gives the budget and the figures it comes from; a warning when the limit is too
    small for the promise (the footprint, the headroom and one largest request per worker do not fit)."""
    fields = {**footprint.fields(), "workers": workers, "memory_budget_bytes": budget, "max_inflight_pixels": pixels}
    if fits(footprint, workers, budget):
        logger.info("memory budget", extra={"fields": fields})
    else:
        logger.warning("memory budget: the memory limit leaves less than one largest request per worker once the "
                       "headroom and the server's footprint are taken off; the server may exceed 85% of it",
                       extra={"fields": fields})


def footprint_after_load(workers: int, shared_dir: str | None, cgroup_root: str = CGROUP_ROOT,
                         pooled: int = 0) -> tuple[Footprint, bool] | None:
    """The server's footprint in its cgroup, read once every worker has loaded its models (each worker calls it
    then, with what its tensor pool holds free, `pooled`), and whether this process read it (and so logs it); None
    without a cgroup limit.

    A lone worker reads it at once. Several workers (`shared_dir`, a folder they all see) read it once: each marks
    itself loaded there, with its `pooled`, and waits for the others, since a reading taken while a sibling still
    loads would miss what that sibling will hold. The first to see them all loaded reads it, with the sum of their
    `pooled`, and publishes it; the others take what was published, and so does any worker gunicorn starts later in
    place of one that died (a reading then would count its siblings' requests in flight)."""
    if workers <= 1 or shared_dir is None:
        return _with_limit(cgroup_memory(cgroup_root), pooled, True)
    folder = Path(shared_dir, "memory")
    folder.mkdir(exist_ok=True)
    published = folder / "footprint.json"
    (folder / f"loaded.{os.getpid()}").write_text(str(pooled))
    while not published.exists():
        loaded = [p for p in folder.glob("loaded.*") if _alive(int(p.suffix[1:]))]
        if len(loaded) >= workers:
            try:
                os.close(os.open(folder / "reading", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass  # a sibling reads it: wait for what it publishes
            else:
                cgroup = cgroup_memory(cgroup_root)
                total = sum(int(p.read_text() or 0) for p in loaded)
                staging = folder / f"footprint.{os.getpid()}.tmp"
                staging.write_text(json.dumps(None if cgroup is None else {"cgroup": asdict(cgroup), "pooled": total}))
                staging.replace(published)  # in one rename: no sibling reads half of it
                return _with_limit(cgroup, total, True)
        time.sleep(SIBLINGS_POLL_S)
    reading = json.loads(published.read_text())
    return (None if reading is None else
            _with_limit(CgroupMemory(**reading["cgroup"]), reading["pooled"], False))


def _with_limit(cgroup: CgroupMemory | None, pooled: int, read_here: bool) -> tuple[Footprint, bool] | None:
    return None if cgroup is None or cgroup.limit is None else (measured_footprint(cgroup, pooled), read_here)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


_C_LIBRARY = ctypes.CDLL(None)  # the process's C library (glibc's heap controls, where it is glibc)


def return_freed_blocks() -> bool:
    """Have blocks of MMAP_THRESHOLD_BYTES or more mapped on their own, so that what a request gives back to the
    memory budget is given back to the system too, whichever thread frees it; False where the C library is not
    glibc (its `mallopt` absent, or a stub that refuses it) and nothing changed."""
    mallopt = getattr(_C_LIBRARY, "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def pool_tensors() -> None:
    """Have TensorFlow keep its tensors in its own pool, reused from call to call, unless the environment already
    chooses. Under the fixed mmap threshold (`return_freed_blocks`) each tensor of a MiB or more would otherwise be
    mapped, faulted in page by page, zeroed and unmapped at every call: a MobileNetV2's activations cost 10-15 ms
    more CPU an image (docs/performance.md). The threshold still returns the decoders' and the requests' own
    buffers; the pool keeps the most that calls held at once, which the memory budget bounds, since serving/core/
    cost.py charges each batch row the pool's peak. Before TensorFlow's runtime starts."""
    os.environ.setdefault(TENSOR_POOL_ENV, "true")


def allocate_within_a_budget() -> None:
    """The allocator of a worker with a memory budget (`return_freed_blocks`, then `pool_tensors`), in one place, so
    that the benchmark's in-process limit (benchmarks/serving.py) runs under what the workers run under."""
    return_freed_blocks()
    pool_tensors()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere)."""
    malloc_trim = getattr(_C_LIBRARY, "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)
