"""The cost per batch size measured at load (serving/core/cost.py), on real functions that burn CPU and hold memory
per row as a model's batch does: the batch size chosen, the memory charged per row, and the bound on its time."""
import time

import numpy as np

from serving.core import cost

MiB = 1 << 20
ROW_BYTES = 16 * MiB  # above glibc's largest mmap threshold: each batch's rows are mapped afresh, as large tensors are


def priced(per_image_s: float, fixed_s: float = 0.0, dearer_from: int = 0, row_bytes: int = ROW_BYTES):
    """A batch function costing `fixed_s` a call plus `per_image_s` a row (3 times that from `dearer_from` rows on)
    of this process's CPU, and holding `row_bytes` a row while it runs."""
    def run(inputs):
        rows = len(inputs["x"])
        held = np.ones(rows * row_bytes // 8)  # written, so resident
        factor = 3 if dearer_from and rows >= dearer_from else 1
        until = time.process_time() + fixed_s + rows * per_image_s * factor
        while time.process_time() < until:
            pass
        return {"y": held[:rows]}
    return run


SAMPLE = {"x": np.array([b"image"], dtype=object)}


def test_batches_stop_at_the_size_past_which_an_image_costs_more_and_each_row_is_charged_its_memory():
    """10 ms of CPU a row: mapping and writing a row's 16 MiB costs 1.5-2.4 ms more, by the machine's state, which
    against 2 ms a row made batches of 2 look 19% dearer than 1 in a CI run. Warmed up first, as the server warms
    its model before the measure: a cold first pass made every size look alike and the measure ran on to 32."""
    run = priced(0.01, dearer_from=4)
    run({"x": np.array([b"image"] * 8, dtype=object)})
    measured = cost.measure(run, SAMPLE, largest=64, seconds=120)
    assert measured.max_batch_size == 2, measured
    assert max(measured.cpu_ms) <= 8, "two sizes dearer in a row end the measure"
    assert ROW_BYTES * 0.9 <= measured.row_bytes <= ROW_BYTES * 1.5, measured
    assert measured.row_pixels * cost.BYTES_PER_PIXEL >= measured.row_bytes


def test_a_model_whose_batches_only_get_cheaper_keeps_max_batch_size_even_when_the_time_runs_out():
    measured = cost.measure(priced(0.0002, fixed_s=0.004, row_bytes=0), SAMPLE, largest=64, seconds=0.5)
    assert measured.max_batch_size == 64, measured
    assert max(measured.cpu_ms) < 64, "the time bound stopped the measure before the largest size"
    per_image = [measured.cpu_ms[size] for size in sorted(measured.cpu_ms)]
    assert per_image == sorted(per_image, reverse=True), measured


class Pool:
    """A tensor pool's counts as TensorFlow's BFC allocator keeps them: what a call holds there shows in the pool's
    peak, not in the process's resident memory, once an earlier call has grown the pool."""

    def __init__(self) -> None:
        self.in_use = self.peak = 0

    def read(self) -> tuple[int, int]:
        counts = (self.in_use, self.peak)
        self.peak = self.in_use
        return counts


def pooled(pool: Pool, per_image_s: float):
    """A batch function costing `per_image_s` a row and holding ROW_BYTES a row in `pool` while it runs."""
    def run(inputs):
        rows = len(inputs["x"])
        pool.in_use += rows * ROW_BYTES
        pool.peak = max(pool.peak, pool.in_use)
        until = time.process_time() + rows * per_image_s
        while time.process_time() < until:
            pass
        pool.in_use -= rows * ROW_BYTES
        return {"y": np.zeros(rows)}
    return run


def test_a_row_held_in_the_tensor_pool_is_charged_from_the_pools_peak():
    pool = Pool()
    pool.in_use = 3 * ROW_BYTES  # the model's own tensors, held throughout
    measured = cost.measure(pooled(pool, 0.002), SAMPLE, largest=8, seconds=120, tensors=pool.read)
    assert ROW_BYTES <= measured.row_bytes <= ROW_BYTES * 1.5, measured
    assert pool.in_use == 3 * ROW_BYTES
