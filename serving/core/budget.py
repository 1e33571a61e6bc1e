"""One memory budget per worker, covering every request in flight (--memory_budget_bytes).

A request costs memory twice over: first its body (the bytes read, the text and objects parsing makes of them,
the decoded inputs), held from the moment it is admitted until it is answered; then the images it decodes, held
only while the TF call that decodes them runs. A JPEG is small on the wire and large decoded (6000 x 6000 of one
colour: 0.56 MB sent, 108 MB decoded), so the two are budgeted apart, within one limit:

- **Pixels** get a fixed share (--max_inflight_pixels, at BYTES_PER_PIXEL each, which also covers what the model
  allocates for the batch). A TF call waits in the batch queue until its pixels fit the share; a call larger than
  the whole share runs alone rather than never.
- **Bodies** get the rest. They are admitted without waiting: a body that does not fit now is refused at once
  (UNAVAILABLE: 503 with Retry-After, or gRPC UNAVAILABLE), at the piece that does not fit as it arrives; one larger
  than the whole body share could never fit and is refused as too large (RESOURCE_EXHAUSTED).

Bodies never wait on pixels and the pixels' share is never lent to bodies, so an admitted request can always
decode its images and finish: the budget can be full but never deadlocked, and what a worker holds for requests
stays within the limit.

A derived budget is measured once the worker's models have loaded (serving/host/memory.py); until it is `settle`d the
budget is pending and refuses every body (UNAVAILABLE), so that nothing is admitted against a limit not yet known.
Only a request that arrives while the worker loads can see that: the REST model APIs wait for the load first,
and gRPC opens after it.
"""
from __future__ import annotations

import threading

from serving import threads
from serving.core.errors import Code, ServingError, unavailable
from serving.memory_costs import BYTES_PER_PIXEL
from serving.metrics import Metrics

# :petal:serving:rejected_requests' reasons for a body refused: no room now (503), more than there ever is (413)
MEMORY_BUDGET = "memory_budget"
TOO_LARGE_FOR_MEMORY_BUDGET = "too_large_for_memory_budget"


class MemoryBudget:
    """`limit` bytes per worker, of which `pixel_limit` decoded pixels are kept for TF calls (0 or less for either:
    that part is not budgeted).

    Safe to call from any thread; nothing here blocks but `acquire`, which only batch and inference threads call.
    With `metrics`, the limits and what is held are exported (:petal:serving:memory_budget_bytes,
    :petal:serving:memory_budget_held_bytes).
    """

    def __init__(self, limit: int, pixel_limit: int, metrics: Metrics | None = None, pending: bool = False):
        self._metrics = metrics
        self._pending = pending
        self._set_limits(limit, pixel_limit)
        self._bodies = 0
        self._pixels = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # `with self._lock` enters it without a Python call
        self._waiting = 0  # TF calls waiting for pixels
        # what is held, exported as it changes: each kind's series resolved once, and only the changed one written
        self._held = (metrics.memory_held.series(kind="bodies"), metrics.memory_held.series(kind="pixels")) \
            if metrics is not None else None

    def _set_limits(self, limit: int, pixel_limit: int) -> None:
        body_limit = limit - max(0, pixel_limit) * BYTES_PER_PIXEL if limit > 0 else 0
        if limit > 0 and body_limit <= 0:
            raise ValueError(f"a budget of {limit} bytes leaves nothing for request bodies after "
                             f"{pixel_limit} pixels")
        self.limit, self.pixel_limit, self.body_limit = limit, pixel_limit, body_limit
        if self._metrics is not None and limit > 0 and not self._pending:
            self._metrics.memory_budget.set(body_limit, kind="bodies")
            self._metrics.memory_budget.set(limit - body_limit, kind="pixels")

    def settle(self, limit: int, pixel_limit: int) -> None:
        """The limits measured once the worker has loaded; bodies are admitted from now on."""
        with self._lock:
            self._pending = False
            self._set_limits(limit, pixel_limit)
            self._cond.notify_all()  # a TF call waiting for pixels may fit the new share

    @property
    def held(self) -> int:
        """Bytes held now, bodies and pixels together."""
        with self._lock:
            return self._bodies + self._pixels * BYTES_PER_PIXEL

    # --- request bodies: admitted or refused at once ----------------------------------------------------------

    def hold(self, nbytes: int) -> Hold:
        """A hold on `nbytes` for one request; it grows as the request learns its cost, and must be released."""
        hold = Hold(self)
        hold.grow(nbytes)
        return hold

    def _take_body(self, nbytes: int, total: int) -> None:
        """Take `nbytes` more for a request that will then hold `total`."""
        if self.limit <= 0 or nbytes <= 0:
            return
        if self._pending:
            raise self._refused(MEMORY_BUDGET, unavailable(
                "This worker's memory budget (--memory_budget_bytes) is measured once its models have loaded; "
                "retry shortly"))
        if total > self.body_limit:
            raise self._refused(TOO_LARGE_FOR_MEMORY_BUDGET, ServingError(
                Code.RESOURCE_EXHAUSTED, f"The request needs about {total} bytes of memory, more than this worker's "
                f"memory budget keeps for requests ({self.body_limit} of --memory_budget_bytes {self.limit}); send "
                "it in smaller requests"))
        with self._lock:
            if self._bodies + nbytes > self.body_limit:
                raise self._refused(MEMORY_BUDGET, unavailable(
                    "This worker's memory budget (--memory_budget_bytes) is taken by the requests in flight; retry "
                    "shortly"))
            self._bodies += nbytes
            self._export_bodies()

    def _refused(self, reason: str, error: ServingError) -> ServingError:
        """A body refused is counted in :petal:serving:rejected_requests by `reason`, with no model: it is refused
        before or as it is read, so before the request names one."""
        if self._metrics is not None:
            self._metrics.rejected.inc(model_name="", reason=reason)
        return error

    def _give_body(self, nbytes: int) -> None:
        if self.limit <= 0 or nbytes <= 0:
            return
        with self._lock:
            self._bodies -= nbytes
            self._export_bodies()

    # --- decoded pixels: waited for -----------------------------------------------------------------------------

    def acquire(self, pixels: int, deadline: float | None = None) -> bool:
        """Take `pixels` for one TF call, waiting until they fit; False if the deadline passes first."""
        if self.pixel_limit <= 0 or pixels <= 0:
            return True
        with self._lock:
            fits = lambda: self._pixels == 0 or self._pixels + pixels <= self.pixel_limit  # noqa: E731
            if not fits():
                self._waiting += 1
                try:
                    if not self._cond.wait_for(fits, threads.timeout_until(deadline)):
                        return False
                finally:
                    self._waiting -= 1
            self._pixels += pixels
            self._export_pixels()
            return True

    def release(self, pixels: int) -> None:
        if self.pixel_limit <= 0 or pixels <= 0:
            return
        with self._lock:
            self._pixels -= pixels
            self._export_pixels()
            if self._waiting:
                self._cond.notify_all()

    # Called under the lock, so the gauge never shows a state that was not.
    def _export_bodies(self) -> None:
        if self._held is not None:
            self._held[0].set(self._bodies)

    def _export_pixels(self) -> None:
        if self._held is not None:
            self._held[1].set(self._pixels * BYTES_PER_PIXEL)


class Hold:
    """What one request holds of a budget's body share; `release` (once, at the request's end) gives it back."""
    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: MemoryBudget):
        self._budget = budget
        self.nbytes = 0

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more, or raise (UNAVAILABLE, RESOURCE_EXHAUSTED) leaving the hold as it was."""
        if nbytes > 0:
            self._budget._take_body(nbytes, self.nbytes + nbytes)
            self.nbytes += nbytes

    def release(self) -> None:
        self._budget._give_body(self.nbytes)
        self.nbytes = 0

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
