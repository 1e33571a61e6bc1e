"""Short garbage-collector pauses for a process that holds TensorFlow and loaded models.

TensorFlow and a loaded SavedModel leave several hundred thousand long-lived objects on the Python heap, and every
full (generation 2) collection walks all of them: 220-350 ms on the 2-core machine, about every 10 s under load,
which showed up as a 300 ms p99 at concurrency 64. Freezing the heap after each model change takes those objects
out of the collector's sight, so a full collection walks only what requests allocated since (15-40 ms there).
Unfreezing first lets the cycles of an unloaded version be collected rather than kept forever.
"""
from __future__ import annotations

import gc
import threading

_lock = threading.Lock()


def settle() -> int:
    """Collect everything, then freeze what survives; returns how many objects are frozen."""
    with _lock:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()
