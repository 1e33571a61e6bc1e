"""Dynamic batching shared by every protocol, with TF Serving's `BatchingParameters` semantics (docs/protocols.md).

Requests for the same (model, version, signature) queue together; `num_batch_threads` threads each take the
oldest ready queue's head, merge up to `max_batch_size` rows, pad to the next `allowed_batch_sizes` entry and
run them in one signature call. With `batch_timeout_micros` 0 (TF Serving's CPU advice) batches form only from
what queued while the threads were busy, so a lone request never waits, and a loaded server batches itself.
A batch that fails with INVALID_ARGUMENT is re-run request by request, so one bad image fails only its own request.
Which signatures batch is decided when a version loads (serving/core/batchable.py); a model whose outputs still do
not follow the batch (its declared shapes said they would) has that batch, and its later requests, run one by one.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from serving import threads
from serving.core.budget import MemoryBudget
from serving.core.errors import Code, ServingError, deadline_exceeded, invalid, unavailable
from serving.metrics import Metrics
from serving.options.config import BatchingOptions

logger = logging.getLogger(__name__)

# What the gevent worker's event loop may run itself (Batcher._short): about a 1920x1080 photo, and the time of a
# call that a client connecting meanwhile can wait for unnoticed.
LOOP_CALL_PIXELS = 2_000_000
LOOP_CALL_US = 10_000
RunFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class BatchKey(NamedTuple):
    """What may share a batch: one signature of one version of one model (a tuple: hashed and compared in C, as
    the batcher's dictionaries do on every request)."""
    model: str
    version: int
    signature: str


@dataclass(slots=True)
class BatchRequest:
    """One request's inputs for the batcher: `rows` rows along dimension 0 (one for inputs that do not batch), each
    with its share of the pixel budget (`row_pixels`, the decoded pixels of that row), answered by `deadline` or
    DEADLINE_EXCEEDED. `run` calls the key's signature; `api` labels its runtime."""
    key: BatchKey
    run: RunFn
    inputs: dict[str, np.ndarray]
    rows: int
    row_pixels: np.ndarray
    deadline: float | None = None
    api: str = "predict"
    batchable: bool = True
    max_rows: int = 0  # the rows a batch of this key may hold, as its measured cost says; 0: max_batch_size


class _Wakeless:
    """The waker of a task that its own request's thread runs: nobody waits for it."""
    __slots__ = ()

    def set(self) -> None:
        pass

    def wait(self, timeout: float | None) -> bool:
        return True


_WAKELESS = _Wakeless()


class _Task:
    __slots__ = ("inputs", "size", "api", "pixels", "enqueued", "queued_us", "done", "outputs", "error", "queue")

    def __init__(self, inputs: dict[str, np.ndarray], size: int, api: str, pixels: int,
                 done: threads.Waker):
        self.inputs = inputs
        self.size = size
        self.api = api
        self.pixels = pixels
        self.enqueued = time.monotonic()
        self.queued_us = 0.0
        self.done = done
        self.outputs: dict[str, np.ndarray] = {}
        self.error: ServingError | None = None
        self.queue: _Queue | None = None


class _Queue:
    __slots__ = ("key", "run", "tasks", "rows", "max_rows")

    def __init__(self, key: BatchKey, run: RunFn, max_rows: int):
        self.key = key
        self.run = run
        self.tasks: collections.deque[_Task] = collections.deque()
        self.rows = 0
        self.max_rows = max_rows  # a batch's rows


def _bug(error: Exception, key: BatchKey) -> ServingError:
    """A bug must fail its requests, never hang them; it is logged with its traceback (call it in `except`)."""
    logger.exception("batch failed", extra={"fields": {"model": key.model}})
    return ServingError(Code.INTERNAL, f"Batch failed: {error}")


class _NotBatched(Exception):
    """A batch's outputs that do not follow it along dimension 0."""


def _total(row_pixels: np.ndarray) -> int:
    """The pixels of every row (numpy's sum of a one-element array costs ten times reading the element)."""
    return int(row_pixels[0]) if len(row_pixels) == 1 else int(row_pixels.sum())


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """Pad by repeating the last real row: unlike zeros, a copy of a real image always decodes."""
    return np.concatenate([array, np.repeat(array[-1:], rows, axis=0)])


def _pad_to_shape(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """TF Serving's pad_variable_length_inputs: pad every non-batch dimension up to the batch's largest."""
    out = np.full((array.shape[0],) + shape, b"" if array.dtype == object else 0, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


class Batcher:
    """One per worker process; `run` blocks the calling request thread until its rows come back.

    At most `num_batch_threads` TF calls run at once. A request that finds nothing queued and a call slot free
    (and, with `batch_timeout_micros` 0, nothing to wait for) takes the slot and runs on its own thread: a batch
    thread would run it at once all the same, and handing it over and back costs thread switches. The gevent
    worker's event loop does so only for a short call while it serves one connection (`_short`); otherwise it
    must keep serving its other connections, and hands the request over. Requests that arrive meanwhile queue and
    batch as before."""

    def __init__(self, options: BatchingOptions, metrics: Metrics, enabled: bool = True,
                 budget: MemoryBudget | None = None):
        self.options = options
        self.enabled = enabled
        self.budget = budget or MemoryBudget(0, 0)
        self._metrics = metrics
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # `with self._lock` enters it without a Python call
        self._queues: dict[BatchKey, _Queue] = {}
        self._unbatched: set[BatchKey] = set()  # keys whose model answered a batch with outputs not batched
        self._queued = 0  # tasks in every queue
        self._running = 0  # TF calls of batches running, on batch threads or on their own request's thread
        self._last_call_us: dict[BatchKey, float] = {}  # how long each key's latest TF call took
        self._closed = False
        self._threads = []
        if enabled:
            for i in range(options.num_batch_threads):
                thread = threading.Thread(target=self._loop, name=f"petal-batch-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def run(self, request: BatchRequest) -> dict[str, np.ndarray]:
        """The outputs for `request`'s rows, merged with other requests for its key.

        A request is split into chunks that each fit both `max_batch_size` and the pixel budget, so one huge
        request cannot hold more than the budget either. Inputs that are not `batchable` (the signature fixes
        dimension 0, or the inputs do not share one), or any inputs with batching off, run alone as one inference,
        within the same deadline and pixel budget.
        """
        if not (self.enabled and request.batchable) or request.key in self._unbatched:
            return self._run_unbatched(request)  # one inference: the model does not batch
        deadline = request.deadline
        if deadline is not None and time.monotonic() >= deadline:
            raise deadline_exceeded("Deadline exceeded before the request was queued")
        bounds = self._chunk_bounds(request.row_pixels, self._max_rows(request))
        if len(bounds) == 1 and (not threads.on_event_loop() or threads.alone_on_loop() and self._short(request)):
            outputs = self._run_here(request)
            if outputs is not None:
                return outputs
        inputs, row_pixels = request.inputs, request.row_pixels
        chunks = [_Task(inputs if (start, stop) == (0, request.rows) else
                        {k: v[start:stop] for k, v in inputs.items()},
                        stop - start, request.api, _total(row_pixels[start:stop]), threads.new_waker())
                  for start, stop in bounds]
        self._enqueue(request, chunks)
        try:
            for task in chunks:
                self._wait(task, deadline)
        except ServingError:
            for task in chunks:  # a split request that failed leaves the queue whole, so no chunk is computed
                self._withdraw(task)
            raise
        if len(chunks) == 1:
            return chunks[0].outputs
        return {k: np.concatenate([t.outputs[k] for t in chunks]) for k in chunks[0].outputs}

    def _short(self, request: BatchRequest) -> bool:
        """Whether a lone request's call is short enough for the gevent worker's event loop to run itself (while it
        serves one connection): one row of at most LOOP_CALL_PIXELS decoded pixels, for a signature whose last call
        took at most LOOP_CALL_US. Handing it to a batch thread and back is half the thread switches of a lone
        request at concurrency 1 (docs/performance.md, 'A lone request on the event loop'); a long call would keep a
        client that connects meanwhile, a health probe say, waiting for all of it."""
        return request.rows == 1 and int(request.row_pixels[0]) <= LOOP_CALL_PIXELS \
            and self._last_call_us.get(request.key, LOOP_CALL_US + 1) <= LOOP_CALL_US

    def _run_here(self, request: BatchRequest) -> dict[str, np.ndarray] | None:
        """Run a request as a batch of its own on the calling thread, if nothing is queued and a call slot is free
        (None otherwise: it queues). Its queue wait is 0, as a batch thread free at once would make it."""
        if self.options.batch_timeout_micros:
            return None  # a batch waits for more requests, on a batch thread
        with self._lock:
            if self._queued or self._running >= self.options.num_batch_threads or self._closed:
                return None
            queue = self._queue_for(request)
            self._running += 1
        task = _Task(request.inputs, request.rows, request.api, _total(request.row_pixels), _WAKELESS)
        self._metrics.queuing_latency.observe(0.0, model_name=request.key.model)
        try:
            self._execute(queue, [task], request.deadline)
        finally:
            with self._lock:
                self._running -= 1
                if self._queued and self._running == self.options.num_batch_threads - 1:
                    self._cond.notify()  # a batch thread may have left what queued meanwhile for want of a slot
        if task.error is not None:
            raise task.error
        if request.deadline is not None and time.monotonic() > request.deadline:
            raise deadline_exceeded("Deadline exceeded while the request was running")
        return task.outputs

    def _run_unbatched(self, request: BatchRequest) -> dict[str, np.ndarray]:
        """Run without batching, keeping the deadline: a running TF call cannot be interrupted, so a call that ends
        past the deadline is answered DEADLINE_EXCEEDED, as a request that waited too long in a queue is. The
        statistics count it as one inference of batch size 1, as Triton counts a request to a model it does not
        batch."""
        deadline = request.deadline
        if deadline is not None and time.monotonic() >= deadline:
            raise deadline_exceeded("Deadline exceeded before the request ran")
        task = _Task(request.inputs, 1, request.api, _total(request.row_pixels), _WAKELESS)
        outputs = threads.run_off_loop(self._call, request.key, request.run, request.inputs, [task], 1, deadline)
        if deadline is not None and time.monotonic() > deadline:
            raise deadline_exceeded("Deadline exceeded while the request was running")
        return outputs

    def _call(self, key: BatchKey, run: RunFn, inputs: dict[str, np.ndarray], tasks: list[_Task], padded: int,
              deadline: float | None) -> dict[str, np.ndarray]:
        """One TF call for `tasks` within the pixel budget, its runtime recorded once for each API among them:
        predict and classify share a batch queue, so the label comes from the requests in the batch, not the
        queue. `padded` is the rows called, padding included."""
        pixels = sum(t.pixels for t in tasks)
        if not self.budget.acquire(pixels, deadline):
            raise deadline_exceeded("Deadline exceeded while waiting for the decoded-pixel budget "
                                    "(--max_inflight_pixels)")
        started = time.monotonic()
        try:
            return run(inputs)
        finally:
            self.budget.release(pixels)
            elapsed_us = self._last_call_us[key] = (time.monotonic() - started) * 1e6
            for api in sorted({t.api for t in tasks}):
                self._metrics.runtime_latency.observe(elapsed_us, model_name=key.model, API=api, runtime="TF")
            self._metrics.record_execution(key.model, key.version, [t.queued_us for t in tasks],
                                           sum(t.size for t in tasks), padded, elapsed_us)

    def _max_rows(self, request: BatchRequest) -> int:
        """The rows one batch of the request's key may hold: what its measured cost chose, within max_batch_size."""
        return min(request.max_rows, self.options.max_batch_size) if request.max_rows else self.options.max_batch_size

    def _chunk_bounds(self, row_pixels: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
        """Consecutive row ranges of at most `max_rows` rows and at most the pixel budget (or one row)."""
        rows = len(row_pixels)
        budget = self.budget.pixel_limit if self.budget.pixel_limit > 0 else None
        if rows <= max_rows and (budget is None or rows == 1):
            return [(0, rows)]  # a request that fits one batch whatever it decodes: no need to look at each row
        bounds, start, held = [], 0, 0
        for row, pixels in enumerate(row_pixels.tolist()):
            full = row - start == max_rows or (budget is not None and held + pixels > budget)
            if row > start and full:
                bounds.append((start, row))
                start, held = row, 0
            held += pixels
        bounds.append((start, rows))
        return bounds

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify_all()

    def forget(self, model: str, version: int) -> None:
        """Drop a retired version's empty queues, so they do not pile up."""
        with self._lock:
            for key in [k for k, q in self._queues.items() if (k.model, k.version) == (model, version) and not q.tasks]:
                del self._queues[key]

    def _queue_for(self, request: BatchRequest) -> _Queue:
        """The key's queue (call holding `_lock`)."""
        queue = self._queues.get(request.key)
        if queue is None:
            queue = self._queues[request.key] = _Queue(request.key, request.run, self._max_rows(request))
        return queue

    def _enqueue(self, request: BatchRequest, tasks: list[_Task]) -> None:
        rows = sum(t.size for t in tasks)
        capacity = self.options.max_enqueued_batches * self.options.max_batch_size
        model = request.key.model
        with self._lock:
            if self._closed:
                raise unavailable("The server is shutting down")
            queue = self._queue_for(request)
            if queue.rows + rows > max(capacity, rows if not queue.tasks else 0):
                self._metrics.rejected.inc(model_name=model, reason="queue_full")
                raise unavailable("The batch scheduling queue to which this task was submitted "
                                  "is full")
            for task in tasks:
                task.queue = queue
            queue.tasks.extend(tasks)
            queue.rows += rows
            self._queued += len(tasks)
            self._metrics.queue_depth.inc(rows, model_name=model)
            self._cond.notify()

    def _wait(self, task: _Task, deadline: float | None) -> None:
        if not task.done.wait(threads.timeout_until(deadline)):
            raise deadline_exceeded("Deadline exceeded while the request was queued or running")
        if task.error is not None:
            raise task.error

    def _withdraw(self, task: _Task) -> None:
        """A request past its deadline leaves the queue at once, so its rows stop counting against the bound and
        are never computed (a task already taken into a batch just finishes unread)."""
        with self._lock:
            queue = task.queue
            if queue is not None and task in queue.tasks:
                queue.tasks.remove(task)
                queue.rows -= task.size
                self._queued -= 1
                self._metrics.queue_depth.inc(-task.size, model_name=queue.key.model)

    def _loop(self) -> None:
        """Take the next batch while a call slot is free. A thread that ends a call gives its slot back as it looks
        for the next batch, so only a request that ran on its own thread wakes a batch thread for its slot."""
        threads.name_native_thread(threading.current_thread().name)  # petal-batch-N in top -H, ps -L and /proc
        ran = False
        while True:
            with self._lock:
                if ran:
                    self._running -= 1
                while True:
                    if self._closed:
                        return
                    queue, wait = self._pick() if self._running < self.options.num_batch_threads else (None, None)
                    if queue is not None:
                        tasks = self._take(queue)
                        if tasks:
                            self._running += 1
                            break
                        continue
                    self._cond.wait(wait)
            self._execute(queue, tasks)
            ran = True

    def _pick(self) -> tuple[_Queue | None, float | None]:
        """The ready queue with the oldest head, else how long until the first open batch times out."""
        now = time.monotonic()
        timeout = self.options.batch_timeout_micros / 1e6
        best, wait = None, None
        for queue in self._queues.values():
            if not queue.tasks:
                continue
            head = queue.tasks[0].enqueued
            if queue.rows >= queue.max_rows or now - head >= timeout:
                if best is None or head < best.tasks[0].enqueued:
                    best = queue
            else:
                remaining = head + timeout - now
                wait = remaining if wait is None else min(wait, remaining)
        return best, wait

    def _take(self, queue: _Queue) -> list[_Task]:
        """The head tasks that fit one batch: the queue's `max_rows`, and the pixel budget after the first task."""
        tasks: list[_Task] = []
        rows, pixels, now = 0, 0, time.monotonic()
        budget = self.budget.pixel_limit if self.budget.pixel_limit > 0 else None
        model = queue.key.model
        while queue.tasks and rows + queue.tasks[0].size <= queue.max_rows and (
                not tasks or budget is None or pixels + queue.tasks[0].pixels <= budget):
            task = queue.tasks.popleft()
            pixels += task.pixels
            queue.rows -= task.size
            self._queued -= 1
            self._metrics.queue_depth.inc(-task.size, model_name=model)
            task.queued_us = (now - task.enqueued) * 1e6
            self._metrics.queuing_latency.observe(task.queued_us, model_name=model)
            tasks.append(task)
            rows += task.size
        return tasks

    def _execute(self, queue: _Queue, tasks: list[_Task], deadline: float | None = None) -> None:
        """Run `tasks` as one batch and hand each its rows or its error. `deadline` bounds the wait for the pixel
        budget of a request that runs on its own thread; a batch thread waits for as long as it takes, since its
        requests' own waits end at their deadlines."""
        try:
            outputs = self._run_batch(queue, tasks, deadline)
        except _NotBatched as error:
            self._run_alone(queue, tasks, str(error))
            return
        except ServingError as error:
            if error.code == "INVALID_ARGUMENT" and len(tasks) > 1:
                for task in tasks:
                    self._execute(queue, [task])
                return
            for task in tasks:
                task.error = error
                task.done.set()
            return
        except Exception as error:
            failure = _bug(error, queue.key)
            for task in tasks:
                task.error = failure
                task.done.set()
            return
        offset = 0
        for task in tasks:
            task.outputs = {k: v[offset:offset + task.size] for k, v in outputs.items()}
            offset += task.size
            task.done.set()

    def _run_batch(self, queue: _Queue, tasks: list[_Task], deadline: float | None) -> dict[str, np.ndarray]:
        rows = sum(t.size for t in tasks)
        padded = self.options.padded_size(rows)
        if len(tasks) == 1 and padded == rows:
            inputs = tasks[0].inputs
        else:
            inputs = {name: self._merge([t.inputs[name] for t in tasks]) for name in tasks[0].inputs}
            if padded > rows:
                inputs = {k: _pad_rows(v, padded - rows) for k, v in inputs.items()}
        model = queue.key.model
        self._metrics.processed_batch_size.observe(padded, model_name=model)
        self._metrics.padding_size.observe(padded - rows, model_name=model, execution_batch_size=str(padded))
        outputs = self._call(queue.key, queue.run, inputs, tasks, padded, deadline)
        for name, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != padded:
                raise _NotBatched(f"output {name} has shape {list(value.shape)} for a batch of {padded}")
        return outputs

    def _run_alone(self, queue: _Queue, tasks: list[_Task], reason: str) -> None:
        """Each task of a batch whose outputs did not follow it, as one inference of its own; the queue's later
        requests skip the batch threads altogether."""
        key = queue.key
        with self._lock:
            first = key not in self._unbatched
            self._unbatched.add(key)
        if first:
            logger.warning("outputs not batched along dimension 0: the signature runs unbatched from now on",
                           extra={"fields": {"model": key.model, "version": key.version, "reason": reason}})
        for task in tasks:
            try:
                task.outputs = self._call(key, queue.run, task.inputs, [task], 1, None)
            except ServingError as error:
                task.error = error
            except Exception as error:
                task.error = _bug(error, key)
            task.done.set()

    def _merge(self, arrays: list[np.ndarray]) -> np.ndarray:
        shapes = {a.shape[1:] for a in arrays}
        if len(shapes) > 1:
            if not self.options.pad_variable_length_inputs or len({len(s) for s in shapes}) > 1:
                raise invalid("Tensors from different requests have different shapes "
                              f"{sorted(shapes)} and padding is turned off")
            target = tuple(max(dims) for dims in zip(*shapes, strict=True))
            arrays = [_pad_to_shape(a, target) for a in arrays]
        return np.concatenate(arrays)
