"""The dynamic batcher in-process: merging, padding, isolation, queue bound, deadlines (far ones too), splitting, and
the pixel budget its calls wait for."""
import dataclasses
import threading
import time

import numpy as np
import pytest
from google.protobuf import text_format

from serving import threads
from serving.core import batching
from serving.core.batching import Batcher, BatchKey, BatchRequest
from serving.core.budget import MemoryBudget
from serving.core.errors import ServingError
from serving.metrics import Metrics
from serving.options.config import BatchingOptions
from serving.options.protos import BatchingParameters


class Recorder:
    """A real batch function: doubles its input and records every batch it was given."""

    def __init__(self, delay: float = 0.0, bad_value: float | None = None):
        self.batches: list[np.ndarray] = []
        self.delay = delay
        self.bad_value = bad_value
        self.lock = threading.Lock()

    def __call__(self, inputs):
        x = inputs["x"]
        with self.lock:
            self.batches.append(x.copy())
        if self.bad_value is not None and (x == self.bad_value).any():
            raise ServingError("INVALID_ARGUMENT", "bad row")
        time.sleep(self.delay)
        return {"y": x * 2, "tag": np.array([f"r{int(v)}".encode() for v in x[:, 0]], dtype=object)}


def request(fn, x, model="m", deadline=None, api="predict", row_pixels=None):
    """A request of the rows of `x` (input "x") for signature "s" of version 1 of `model`."""
    return BatchRequest(BatchKey(model, 1, "s"), fn, {"x": x}, len(x),
                        np.zeros(len(x), np.int64) if row_pixels is None else row_pixels, deadline, api)


def run_concurrently(batcher, fn, values, key="m", deadline=None):
    results, errors = {}, {}

    def one(v):
        try:
            results[v] = batcher.run(request(fn, np.array([[v]], np.float32), key, deadline))
        except ServingError as error:
            errors[v] = error
    threads = [threading.Thread(target=one, args=(v,)) for v in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_concurrent_requests_merge_and_each_gets_its_own_rows():
    metrics = Metrics()
    batcher = Batcher(BatchingOptions(max_batch_size=16, batch_timeout_micros=100_000, num_batch_threads=1),
                      metrics)
    fn = Recorder()
    results, errors = run_concurrently(batcher, fn, list(range(8)))
    assert not errors
    assert len(fn.batches) < 8, "requests that arrived together should share batches"
    for v, out in results.items():
        assert out["y"].tolist() == [[2.0 * v]] and out["tag"].tolist() == [f"r{v}".encode()]
    assert metrics.processed_batch_size.count(model_name="m") == len(fn.batches)
    batcher.close()


def test_pads_to_allowed_batch_sizes_and_never_returns_padding():
    batcher = Batcher(BatchingOptions(max_batch_size=8, allowed_batch_sizes=(4, 8), num_batch_threads=1), Metrics())
    fn = Recorder()
    out = batcher.run(request(fn, np.array([[1.0], [2.0], [3.0]], np.float32)))
    assert [b.shape[0] for b in fn.batches] == [4]
    assert fn.batches[0][3, 0] == 3.0, "padding repeats the last real row"
    assert out["y"].tolist() == [[2.0], [4.0], [6.0]]
    batcher.close()


def test_batches_never_mix_models_or_versions():
    batcher = Batcher(BatchingOptions(max_batch_size=32, batch_timeout_micros=50_000, num_batch_threads=2),
                      Metrics())
    seen: dict[str, list] = {"a": [], "b": []}

    def make(key):
        def fn(inputs):
            seen[key].append(inputs["x"][:, 0].tolist())
            return {"y": inputs["x"]}
        return fn
    fns = {"a": make("a"), "b": make("b")}
    barrier = threading.Barrier(12)

    def one(key, v):
        barrier.wait()
        batcher.run(request(fns[key], np.array([[v]], np.float32), key))
    threads = [threading.Thread(target=one, args=("a" if i % 2 else "b", float(i % 2))) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(set(batch) == {1.0} for batch in seen["a"]) and all(set(batch) == {0.0} for batch in seen["b"])
    assert sum(map(len, seen["a"])) == 6 and sum(map(len, seen["b"])) == 6
    batcher.close()


def test_invalid_row_fails_only_its_own_request():
    batcher = Batcher(BatchingOptions(max_batch_size=16, batch_timeout_micros=100_000, num_batch_threads=1),
                      Metrics())
    fn = Recorder(bad_value=3.0)
    results, errors = run_concurrently(batcher, fn, list(range(6)))
    assert set(errors) == {3} and errors[3].code == "INVALID_ARGUMENT"
    assert sorted(results) == [0, 1, 2, 4, 5]
    assert any(b.shape[0] > 1 for b in fn.batches), "the bad row was first run inside a merged batch"
    batcher.close()


def test_full_queue_rejects_with_unavailable_then_recovers():
    metrics = Metrics()
    batcher = Batcher(BatchingOptions(max_batch_size=1, max_enqueued_batches=1, num_batch_threads=1), metrics)
    fn = Recorder(delay=0.2)
    results, errors = run_concurrently(batcher, fn, list(range(6)))
    assert errors and all(e.code == "UNAVAILABLE" for e in errors.values())
    # At least the first request runs; how many more fit depends on when the batch thread picks it up.
    assert results and len(results) + len(errors) == 6
    assert metrics.rejected.value(model_name="m", reason="queue_full") == len(errors)
    out = batcher.run(request(fn, np.array([[7.0]], np.float32)))
    assert out["y"].tolist() == [[14.0]]
    batcher.close()


def test_deadline_exceeded_while_waiting():
    batcher = Batcher(BatchingOptions(max_batch_size=8, batch_timeout_micros=1_000_000, num_batch_threads=1),
                      Metrics())
    fn = Recorder()
    started = time.monotonic()
    with pytest.raises(ServingError) as info:
        batcher.run(request(fn, np.array([[1.0]], np.float32), deadline=time.monotonic() + 0.1))
    assert info.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - started < 0.9
    time.sleep(1.0)
    assert fn.batches == [], "a timed-out request is dropped, not run"
    batcher.close()


def test_a_timed_out_request_frees_its_queue_slot_at_once():
    """The queue holds one batch; a request that gave up must not keep the next one out until a thread frees."""
    batcher = Batcher(BatchingOptions(max_batch_size=1, max_enqueued_batches=1, num_batch_threads=1,
                                      batch_timeout_micros=0), Metrics())
    fn = Recorder(delay=0.6)
    running = threading.Thread(target=batcher.run, args=(request(fn, np.array([[1.0]], np.float32)),))
    running.start()
    time.sleep(0.2)  # the only batch thread is busy with row 1 for 0.6 s
    with pytest.raises(ServingError) as info:
        batcher.run(request(fn, np.array([[2.0]], np.float32), deadline=time.monotonic() + 0.1))
    assert info.value.code == "DEADLINE_EXCEEDED"
    out = batcher.run(request(fn, np.array([[3.0]], np.float32), deadline=time.monotonic() + 5))
    assert out["y"].tolist() == [[6.0]]
    running.join()
    assert [b.tolist() for b in fn.batches] == [[[1.0]], [[3.0]]], "the timed-out row was never computed"
    batcher.close()


def test_large_request_is_split_into_max_size_batches():
    batcher = Batcher(BatchingOptions(max_batch_size=4, num_batch_threads=2), Metrics())
    fn = Recorder()
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    out = batcher.run(request(fn, x))
    assert max(b.shape[0] for b in fn.batches) == 4
    assert out["y"][:, 0].tolist() == (x[:, 0] * 2).tolist()
    batcher.close()


def test_disabled_batching_calls_directly():
    batcher = Batcher(BatchingOptions(), Metrics(), enabled=False)
    fn = Recorder()
    results, errors = run_concurrently(batcher, fn, [1, 2, 3])
    assert not errors and all(b.shape[0] == 1 for b in fn.batches) and len(fn.batches) == 3


def test_options_from_tf_serving_text_proto():
    proto = text_format.Parse("max_batch_size { value: 8 } batch_timeout_micros { value: 2000 } "
                              "num_batch_threads { value: 3 } allowed_batch_sizes: 2 allowed_batch_sizes: 8",
                              BatchingParameters())
    options = BatchingOptions.from_proto(proto)
    assert (options.max_batch_size, options.batch_timeout_micros, options.num_batch_threads) == (8, 2000, 3)
    assert options.allowed_batch_sizes == (2, 8) and options.padded_size(3) == 8
    with pytest.raises(ValueError):
        BatchingOptions(max_batch_size=8, allowed_batch_sizes=(2, 4))


def test_runtime_latency_is_labelled_with_the_apis_of_the_requests_in_the_batch():
    """predict and classify share a queue; the first request to create it must not label the other's runtime."""
    metrics = Metrics()
    batcher = Batcher(BatchingOptions(max_batch_size=8, batch_timeout_micros=300_000, num_batch_threads=1), metrics)
    outputs = {}

    def one(api: str, value: float) -> None:
        outputs[api] = batcher.run(request(Recorder(), np.array([[value]], np.float32), api=api))
    threads = [threading.Thread(target=one, args=(api, v)) for api, v in (("predict", 1.0), ("classify", 2.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert outputs["predict"]["y"][0, 0] == 2.0 and outputs["classify"]["y"][0, 0] == 4.0
    assert metrics.runtime_latency.count(model_name="m", API="predict", runtime="TF") == 1
    assert metrics.runtime_latency.count(model_name="m", API="classify", runtime="TF") == 1
    assert metrics.processed_batch_size.count(model_name="m") == 1  # one batch served both APIs


def test_pixel_budget_bounds_what_batches_decode_at_once():
    """Rows are chunked and batched so that the pixels in TF calls at any moment never exceed the budget."""
    held, peak, lock = [0], [0], threading.Lock()

    def fn(inputs):
        pixels = int(inputs["x"][:, 0].sum())
        with lock:
            held[0] += pixels
            peak[0] = max(peak[0], held[0])
        time.sleep(0.05)
        with lock:
            held[0] -= pixels
        return {"y": inputs["x"] * 2}
    batcher = Batcher(BatchingOptions(max_batch_size=64, num_batch_threads=2), Metrics(), budget=MemoryBudget(0, 10))
    results = []

    def one(rows: int) -> None:
        x = np.full((rows, 1), 4.0, np.float32)  # each row "decodes" 4 pixels
        results.append(batcher.run(request(fn, x, row_pixels=np.full(rows, 4)))["y"])
    threads = [threading.Thread(target=one, args=(rows,)) for rows in (5, 3, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sorted(len(r) for r in results) == [1, 3, 5] and all((r == 8.0).all() for r in results)
    assert 0 < peak[0] <= 10


def test_pixel_budget_waits_and_lets_an_oversized_call_run_alone():
    budget = MemoryBudget(0, 10)
    assert budget.acquire(8)
    assert not budget.acquire(5, deadline=time.monotonic() + 0.1)  # would exceed: waits, then gives up
    released = threading.Timer(0.1, budget.release, args=(8,))
    released.start()
    assert budget.acquire(5, deadline=time.monotonic() + 5)  # fits once the first call is done
    budget.release(5)
    assert budget.acquire(50)  # larger than the budget: runs alone rather than never
    budget.release(50)
    assert MemoryBudget(-1, -1).acquire(10 ** 12)


# A deadline past threading.TIMEOUT_MAX (Triton's perf_analyzer sends them): its wait raised OverflowError, which
# became INTERNAL or a 500.
FAR = 2 * threading.TIMEOUT_MAX


def test_the_pixel_budget_waits_for_room_under_a_far_deadline():
    budget = MemoryBudget(0, 10)
    assert budget.acquire(8)
    threading.Timer(0.2, budget.release, args=(8,)).start()
    assert budget.acquire(8, time.monotonic() + FAR)


def test_a_batched_request_with_a_far_deadline_runs():
    # a batch timeout, so the request waits in the queue for a batch thread rather than running on its own
    batcher = Batcher(BatchingOptions(max_batch_size=4, num_batch_threads=1, batch_timeout_micros=1), Metrics())
    try:
        def slow_double(inputs):
            time.sleep(0.1)  # the request is still waiting when the batch thread runs it
            return {"y": inputs["x"] * 2}
        out = batcher.run(BatchRequest(BatchKey("m", 1, "s"), slow_double, {"x": np.arange(3.0)}, 3,
                                       np.zeros(3, np.int64), deadline=time.monotonic() + FAR))
        assert out["y"].tolist() == [0.0, 2.0, 4.0]
    finally:
        batcher.close()


def test_a_model_whose_outputs_do_not_follow_the_batch_answers_each_request_alone():
    """Its declared shapes said it batches, but it answers a batch with one scalar: never INTERNAL. Each request of
    that batch runs again alone, and the later ones skip the batch queue."""
    calls = []

    def total(inputs):
        calls.append(inputs["x"].shape[0])
        time.sleep(0.02)
        return {"y": np.float32(inputs["x"].sum())}

    batcher = Batcher(BatchingOptions(max_batch_size=16, batch_timeout_micros=100_000, num_batch_threads=1),
                      Metrics())
    results, errors = run_concurrently(batcher, total, [1.0, 2.0, 3.0])
    assert not errors, errors
    assert {v: float(out["y"]) for v, out in results.items()} == {1.0: 1.0, 2.0: 2.0, 3.0: 3.0}
    assert calls[0] > 1 and set(calls[1:]) == {1}  # a batch, then each of its requests alone
    calls.clear()
    results, errors = run_concurrently(batcher, total, [4.0, 5.0])
    assert not errors and calls == [1, 1] and {float(out["y"]) for out in results.values()} == {4.0, 5.0}
    batcher.close()


class Threads:
    """A batch function that records the thread of each call (its ident and name) and the most calls ever running
    at once."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.idents: list[int] = []
        self.names: list[str] = []
        self.running = self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, inputs):
        with self.lock:
            self.idents.append(threading.get_ident())
            self.names.append(threading.current_thread().name)
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1
        return {"y": inputs["x"] * 2}


def test_a_lone_request_runs_on_its_own_thread_and_no_more_calls_run_than_batch_threads():
    """Nothing queued and a call slot free: the request's thread runs it (no handoff to a batch thread and back).
    Under load the requests' own runs and the batch threads' together never exceed num_batch_threads calls."""
    batcher = Batcher(BatchingOptions(max_batch_size=8, num_batch_threads=2), Metrics())
    fn = Threads()
    out = batcher.run(request(fn, np.array([[1.0]], np.float32)))
    assert out["y"].tolist() == [[2.0]] and fn.idents == [threading.get_ident()]

    fn = Threads(delay=0.05)  # another model: a key's queue keeps the function it was created with
    results, errors = run_concurrently(batcher, fn, list(range(12)), key="m2")
    assert not errors and {v: out["y"].tolist() for v, out in results.items()} == {v: [[2.0 * v]] for v in range(12)}
    assert fn.peak == 2, "two call slots, both used, never more"
    assert len(fn.idents) < 12, "requests that queued behind busy slots were batched"
    assert {name for name in fn.names if name.startswith("petal-batch-")}, "the batch threads took what queued"
    batcher.close()


def on_a_loop(alone: bool, calls) -> tuple[int, list]:
    """Run `calls` (functions of no argument) in order on a thread that serves as the gevent worker's event loop,
    its worker serving a single connection if `alone`; the loop thread's ident and what each call returned."""
    seen: dict[str, object] = {}

    def loop_thread():
        threads.serve_on_gevent_loop(1, alone=lambda: alone)
        seen["loop"] = threading.get_ident()
        seen["out"] = [call() for call in calls]

    thread = threading.Thread(target=loop_thread)
    thread.start()
    thread.join(10)
    return seen["loop"], seen["out"]


@pytest.mark.parametrize("case", ["alone", "other connections", "slow signature", "large photo", "two rows"])
def test_the_event_loop_runs_a_lone_short_call_itself_only_while_it_serves_one_connection(monkeypatch, case):
    """A call the loop runs keeps every other client waiting: only one of a single row, a photo of at most
    LOOP_CALL_PIXELS and a signature whose last call was short, while no other connection is open."""
    monkeypatch.setattr(threads, "_loop", {})
    batcher = Batcher(BatchingOptions(max_batch_size=8, num_batch_threads=1), Metrics())
    fn = Threads(delay=0.05 if case == "slow signature" else 0.0)
    rows = 2 if case == "two rows" else 1
    pixels = np.full(rows, batching.LOOP_CALL_PIXELS + (1 if case == "large photo" else 0), np.int64)
    x = np.full((rows, 1), 3.0, np.float32)

    def call():  # a deadline: with nothing else for the loop to watch, gevent would find the wait endless
        return batcher.run(request(fn, x, deadline=time.monotonic() + 5, row_pixels=pixels))["y"].tolist()
    loop, outs = on_a_loop(case != "other connections", [call, call])
    assert outs == [[[6.0]] * rows] * 2
    assert fn.names[0] == "petal-batch-0", "a signature's first call: how long it takes is not known yet"
    if case == "alone":
        assert fn.idents[1] == loop
    else:
        assert fn.names[1] == "petal-batch-0"
    batcher.close()


def test_a_key_whose_cost_caps_its_batches_gets_batches_no_larger_and_a_queue_as_long_as_before():
    """A request's `max_rows` (what its model's measured cost chose, serving/core/cost.py) bounds the batches of its
    key, below max_batch_size; the queue still holds max_enqueued_batches x max_batch_size rows, so the smaller
    batches refuse no more requests."""
    batcher = Batcher(BatchingOptions(max_batch_size=8, max_enqueued_batches=2, num_batch_threads=1), Metrics())
    fn = Recorder(delay=0.02)
    results, errors = {}, {}

    def one(v):
        try:
            results[v] = batcher.run(dataclasses.replace(request(fn, np.array([[v]], np.float32)), max_rows=2))
        except ServingError as error:
            errors[v] = error
    workers = [threading.Thread(target=one, args=(v,)) for v in range(16)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors and sorted(results) == list(range(16))
    assert max(b.shape[0] for b in fn.batches) == 2 and any(b.shape[0] == 2 for b in fn.batches)
    assert all(results[v]["y"].tolist() == [[2.0 * v]] for v in results)
    split = batcher.run(dataclasses.replace(request(fn, np.arange(5, dtype=np.float32).reshape(5, 1)), max_rows=2))
    assert split["y"][:, 0].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0] and max(b.shape[0] for b in fn.batches) == 2
    batcher.close()
