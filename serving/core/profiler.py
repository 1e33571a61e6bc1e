"""TensorFlow's profiler in this worker, for the gRPC port's tensorflow.ProfilerService (TF Serving's "Profile
Inference Requests with TensorBoard"; docs/protocols.md).

A trace is a TensorFlow ProfilerSession in this process, so it records what this worker's TensorFlow runs (its
batches, a lone request's call, their ops and threads) while it lasts. TensorFlow allows one session per process,
and a trace costs the worker CPU and memory for every event it records: so one runs at a time per worker (another
is refused at once), for at most MAX_TRACE_S. What it collected is an XSpace, saved where TensorFlow's profiler
server saves it (`<repository_root>/<session_id>/<host>.xplane.pb`, which TensorBoard's profile plugin reads).
"""
from __future__ import annotations

import glob
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from tensorflow.python.profiler.internal import _pywrap_profiler

from serving.core.errors import Code, ServingError, invalid

MAX_TRACE_S = 60.0
XPLANE_SUFFIX = ".xplane.pb"


def _outline() -> Any:
    """XSpace's planes, lines and events (tsl/profiler/protobuf/xplane.proto's field numbers: planes 1, lines 3,
    events 4), read for whether any event was recorded. TensorFlow's Python xplane_pb2 cannot be used: its
    string fields refuse what the C++ profiler writes there (not UTF-8)."""
    file = descriptor_pb2.FileDescriptorProto(name="petal/xspace_outline.proto", package="petal", syntax="proto3")
    field = descriptor_pb2.FieldDescriptorProto
    for name, number, kind, of in (("XSpaceOutline", 1, field.TYPE_MESSAGE, ".petal.XPlaneOutline"),
                                   ("XPlaneOutline", 3, field.TYPE_MESSAGE, ".petal.XLineOutline"),
                                   ("XLineOutline", 4, field.TYPE_BYTES, "")):
        item = file.message_type.add(name=name).field.add(name="items", number=number, type=kind,
                                                          label=field.LABEL_REPEATED)
        if of:
            item.type_name = of
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("petal.XSpaceOutline"))


_XSpaceOutline = _outline()


def has_events(xspace: bytes) -> bool:
    """Whether a serialized XSpace holds an event (TensorFlow's IsEmpty, negated)."""
    return any(line.items for plane in _XSpaceOutline.FromString(xspace).items for line in plane.items)


class Profiler:
    """One worker's traces: at most one at a time."""

    def __init__(self) -> None:
        self._busy = threading.Lock()

    def trace(self, duration_s: float, wait: Callable[[float], None]) -> bytes:
        """Trace for `duration_s`, which `wait` sleeps (and may end early); the serialized XSpace collected.
        INVALID_ARGUMENT for a duration out of (0, MAX_TRACE_S]; ALREADY_EXISTS while another trace runs (TensorFlow's
        own profiler service's code and words for a second continuous session)."""
        if not 0 < duration_s <= MAX_TRACE_S:
            raise invalid(f"A trace lasts more than 0 and at most {MAX_TRACE_S * 1000:.0f} ms; "
                          f"{duration_s * 1000:.0f} ms was asked for")
        if not self._busy.acquire(blocking=False):
            raise ServingError(Code.ALREADY_EXISTS, "A profiling session is already running in this worker: one "
                               "trace at a time; retry once it ends")
        try:
            with tempfile.TemporaryDirectory(prefix="petal-trace-") as logdir:
                session = _pywrap_profiler.ProfilerSession()
                try:
                    session.start(logdir, {})  # TensorFlow's default levels: host 2, device 1, Python 0
                except Exception as error:  # a session started by other code in this process
                    raise ServingError(Code.UNAVAILABLE, f"TensorFlow's profiler cannot start: {error}") from None
                try:
                    wait(duration_s)
                finally:
                    session.export_to_tb()  # the XSpace, to <logdir>/plugins/profile/<run>/<host>.xplane.pb
                for path in glob.glob(os.path.join(logdir, "plugins", "profile", "*", f"*{XPLANE_SUFFIX}")):
                    with open(path, "rb") as f:
                        return f.read()
                return b""  # nothing collected: an empty XSpace
        finally:
            self._busy.release()


def trace_path(repository_root: str, run: str, host: str) -> str:
    """Where TensorFlow's SaveXSpace saves a trace: `<repository_root>/<run>/<host>.xplane.pb`, a colon in the host
    written `_`. Checked before the trace starts, so a request that could not be saved is refused at once. `run` and
    `host` name a folder and a file in it, nothing more."""
    if not repository_root:
        raise invalid("repository_root is empty: the client names the folder the trace is saved in")
    for what, name in (("session_id", run), ("host_name", host)):
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise invalid(f"{what} must name one folder or file: {name!r}")
    return f"{repository_root.rstrip('/')}/{run}/{host.replace(':', '_')}{XPLANE_SUFFIX}"


def save(xspace: bytes, path: str) -> None:
    """Write the trace at `path` (`trace_path`) through tf.io.gfile, so to any file system TensorFlow writes to."""
    try:
        tf.io.gfile.makedirs(path.rsplit("/", 1)[0])
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(xspace)
    except tf.errors.OpError as error:
        raise ServingError(Code.FAILED_PRECONDITION, f"Cannot save the trace to {path}: {error.message}") from None
