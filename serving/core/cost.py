"""What a batch of each size costs a loaded model, measured once at load, and the batch size it argues for.

TF Serving's advice leaves `max_batch_size` to the user. Its cost is the model's: on a CPU a batch of a small
model's images costs less per image than one image does (the call's fixed cost is shared), while a large model's
batch of 16 or 32 can cost more per image than a batch of 1 to 4 (its activations outgrow the caches), and its
activations take memory that the budget must count (docs/performance.md, 'Batches sized by what they cost').

So, right after warmup, batches of the warmup's first image are run at each size in turn (1, 2, 4, ... up to
`max_batch_size`), and for each are read the CPU per image (the process's CPU time, the model's intra-op threads
included, which unlike a wall clock other processes on the machine hardly move; the mean of a few calls, the least
of a few passes) and the memory a call adds at its peak: the resident high-water mark, reset before each call, or
where more, the peak of TensorFlow's tensor pool (serving/host/memory.py's `pool_tensors`), which a call reuses
rather than grows once an earlier call has grown it, so that the resident mark alone would miss it.
The measure stops at its time bound, or once larger batches have cost more per image twice in a row, then measures
the same sizes again while its time lasts.

The batcher then forms batches of at most the largest size measured within COST_TOLERANCE of the cheapest per
image; only where the largest size measured was the cheapest (the sizes or the time ran out while batches still got
cheaper) of up to `max_batch_size`, as without the measure: a falling cost is carried on, a flat one is not, so
that a busy machine, which leaves time for fewer sizes, never lifts the bound on a model that batches badly.
Either way each row is charged the most memory a row added, in the pixel share of serving/core/budget.py, so that
the batches formed and run at once stay within the memory budget.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from serving.host.memory import HEADROOM, available_memory, cgroup_memory, trim_heap
from serving.memory_costs import BYTES_PER_PIXEL

# A batch size within this of the cheapest per image is as good (the least of many calls still moves by 5-10% on a
# busy machine); one dearer than that is dearer.
COST_TOLERANCE = 0.10
CALLS, MAX_CALLS, SIZE_CPU_S = 3, 30, 0.1  # calls per size and pass, and the CPU they fill
PASSES = 3  # over the sizes, while the time lasts
RISES = 2  # consecutive sizes dearer per image than the cheapest so far that end the measure
STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


@dataclass(frozen=True)
class BatchCost:
    """A signature's measured cost: CPU ms per image and bytes added per row at each batch size measured, the
    batch size chosen from them, and the bytes charged per row (the most any size added per row)."""
    max_batch_size: int
    row_bytes: int
    cpu_ms: dict[int, float] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def row_pixels(self) -> int:
        """`row_bytes` in the pixel share's unit."""
        return -(-self.row_bytes // BYTES_PER_PIXEL)

    def fields(self) -> dict[str, object]:
        """For the load's log line."""
        return {"max_batch_size": self.max_batch_size, "row_bytes": self.row_bytes, "seconds": round(self.seconds, 2),
                "cpu_ms_per_image": {size: round(ms, 3) for size, ms in self.cpu_ms.items()},
                "peak_bytes": self.peak_bytes}


def _resident() -> tuple[int, int] | None:
    """(resident, high-water mark) bytes of this process, None where /proc does not say."""
    try:
        with open(STATUS) as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _reset_peak() -> bool:
    """Reset the resident high-water mark to what is resident now (Linux's clear_refs "5")."""
    trim_heap()  # so that what a call adds is its own, not less for pages an earlier call freed and kept
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _room() -> int:
    """Bytes a measured batch may add: half what the memory limit leaves, less the headroom, once what the cgroup
    (or, without one, this process) holds is counted, as the pixel share is half of the budget."""
    cgroup = cgroup_memory()
    held = cgroup.usage if cgroup is not None and cgroup.limit is not None else (_resident() or (0, 0))[0]
    return int((available_memory() * (1 - HEADROOM) - held) / 2)


TensorPool = Callable[[], "tuple[int, int] | None"]  # (in use, peak) bytes, the peak then reset; None: no pool


def _call(run: Callable[[dict[str, np.ndarray]], object], inputs: dict[str, np.ndarray],
          tensors: TensorPool) -> tuple[float, int]:
    """CPU seconds of one call, and the bytes it added at its peak over what was held before it: resident, or in
    the tensor pool where that says more (0 where neither can be read)."""
    before = _resident() if _reset_peak() else None
    pool_before = tensors()
    cpu = time.process_time()
    run(inputs)
    cpu = time.process_time() - cpu
    after = _resident() if before is not None else None
    pool_after = tensors() if pool_before is not None else None
    resident = max(0, after[1] - before[0]) if before is not None and after is not None else 0
    pooled = max(0, pool_after[1] - pool_before[0]) if pool_before is not None and pool_after is not None else 0
    return cpu, max(resident, pooled)


def _size_cost(run: Callable[[dict[str, np.ndarray]], object], batch: dict[str, np.ndarray],
               tensors: TensorPool) -> tuple[float, int, int]:
    """The mean CPU seconds of a few calls on `batch` (at least CALLS, and at least SIZE_CPU_S in all, at most
    MAX_CALLS; a mean, since the process's CPU clock lags a thread still running on another core by up to a tick,
    which the least of short calls would pick), the most bytes one added, and the calls made."""
    calls = [_call(run, batch, tensors)]
    while len(calls) < MAX_CALLS and (len(calls) < CALLS or sum(cpu for cpu, _ in calls) < SIZE_CPU_S):
        calls.append(_call(run, batch, tensors))
    return sum(cpu for cpu, _ in calls) / len(calls), max(added for _, added in calls), len(calls)


def measure(run: Callable[[dict[str, np.ndarray]], object], sample: dict[str, np.ndarray], largest: int,
            seconds: float, tensors: TensorPool = lambda: None) -> BatchCost:
    """The cost of `run` on batches of `sample`'s first row, at 1, 2, 4, ... up to `largest` rows, within
    `seconds`: a size whose calls would pass it (by the last size's CPU per image), or whose memory would pass
    half what the memory limit leaves (by the most a row has added), is not started. The sizes are
    measured once in turn, then again, in turn, while the time lasts (PASSES at most), each keeping its least pass: a
    slow spell of the machine then falls on every size rather than on one. `tensors` reads the tensor pool
    (serving/core/runtimes.py's `tensor_pool`)."""
    started = time.monotonic()
    cpu: dict[int, float] = {}  # CPU seconds per image, the least pass's
    peak: dict[int, int] = {}
    wall: dict[int, float] = {}  # the latest pass's seconds per image, by which the time a size takes is foreseen
    batches: dict[int, dict[str, np.ndarray]] = {}
    size, rises, room = 1, 0, _room()

    def fits(size: int) -> bool:
        if not cpu:
            return True
        if size not in cpu and size * max(added // s for s, added in peak.items()) > room:
            return False
        known = size if size in cpu else max(cpu)  # this size's own pace once it has one, else the largest's so far
        expected = max(CALLS * size * wall[known], SIZE_CPU_S * wall[known] / max(cpu[known], 1e-9))
        return time.monotonic() - started + expected <= seconds

    def measure_size(size: int) -> None:
        began = time.monotonic()
        mean, added, calls = _size_cost(run, batches[size], tensors)
        wall[size] = (time.monotonic() - began) / size / calls
        cpu[size] = min(cpu.get(size, mean / size), mean / size)
        peak[size] = max(peak.get(size, 0), added)

    while size <= largest and rises < RISES and fits(size):
        batches[size] = {name: np.repeat(value[:1], size, axis=0) for name, value in sample.items()}
        measure_size(size)
        rises = rises + 1 if cpu[size] > min(cpu.values()) * (1 + COST_TOLERANCE) else 0
        size = size * 2 if size * 2 <= largest or size == largest else largest
    for _ in range(PASSES - 1):
        for size in batches:
            if fits(size):
                measure_size(size)
    cheapest = min(cpu.values())
    good = [s for s, each in cpu.items() if each <= cheapest * (1 + COST_TOLERANCE)]
    falling = not rises and cpu[max(cpu)] == cheapest  # the largest size measured was the cheapest yet
    return BatchCost(largest if falling else max(good), max(added // s for s, added in peak.items()),
                     {s: each * 1000 for s, each in cpu.items()}, peak, time.monotonic() - started)
