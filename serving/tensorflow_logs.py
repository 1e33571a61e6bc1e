"""TensorFlow's C++ start-up lines, hidden unless asked for.

Importing TensorFlow 2.21 prints, before Python's logging or TensorFlow's own log level are in charge, absl's
"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", the oneDNN notice and
"Could not find cuda drivers on your machine", twice (two of its libraries each carry absl). TF_CPP_MIN_LOG_LEVEL
hides what TensorFlow logs once it has started (the CPU instructions notice), but not these; and below 3 it lets
through, as an ERROR line, the failed cuInit of a machine that has CUDA's libraries and no GPU, which only says
that the machine has none. So `import_tensorflow` imports it, and starts its CUDA platform, with this process's
stderr (file descriptor 2, which C++ writes to) passed through a filter that applies TF_CPP_MIN_LOG_LEVEL to those
lines too: absl's lines below the level are dropped, and so is that cuInit error where no NVIDIA driver is loaded;
other errors and fatal lines always pass, and so does everything that is not absl's (Python's warnings, a crash's
last words), at once. At level 0 (`petal --verbose` sets it) nothing is filtered.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator

# absl's prefix: severity, date, time, thread id, file:line]
ABSL_LINE = re.compile(rb"([IWEF])\d{4} [\d:.]+ +\d+ [^\]\s]+:\d+\] ")
PRE_INIT_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# TensorFlow's CUDA platform, as it starts on a machine whose CUDA libraries are installed but that has no GPU (an
# ERROR line whatever TF_CPP_MIN_LOG_LEVEL below 3 says): "failed call to cuInit: ... UNKNOWN ERROR (303)".
NO_GPU_ERROR = re.compile(rb"\] failed call to cuInit: ")
SEVERITIES = {b"I": "INFO", b"W": "WARNING", b"E": "ERROR", b"F": "CRITICAL"}  # absl's, in order; Python's names
ERROR = 2
PIPE_BYTES = 1 << 20  # so that a burst while the importing thread holds the GIL never blocks the writer
MAX_LINE_BYTES = 1 << 20  # a writer that never ends a line has it written out in pieces this long
INTERRUPTED_RELAY_S = 2.0


def min_log_level() -> int:
    """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it: 0 (everything) unless set."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def shown(line: bytes, level: int) -> bool:
    """Whether a line TensorFlow's C++ writes to stderr is shown at TF_CPP_MIN_LOG_LEVEL `level`. An error that
    says only that a machine with no NVIDIA GPU has none is not one: it is hidden below level 0 too."""
    if line.rstrip(b"\r") == PRE_INIT_NOTICE:
        return level <= 0
    match = ABSL_LINE.match(line)
    if match is not None and level > 0 and NO_GPU_ERROR.search(line) and not has_nvidia_gpu():
        return False
    return match is None or list(SEVERITIES).index(match.group(1)) >= min(level, ERROR)


@functools.cache
def has_nvidia_gpu() -> bool:
    """Whether NVIDIA's driver is loaded on this machine (its control device, or its /proc folder)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def import_tensorflow() -> None:
    """Import TensorFlow (once per process) without the lines its C++ prints at import that TF_CPP_MIN_LOG_LEVEL
    asks to hide."""
    if "tensorflow" in sys.modules:
        return
    level = min_log_level()
    with stderr_filtered(functools.partial(shown, level=level)) if level > 0 else contextlib.nullcontext():
        tensorflow = importlib.import_module("tensorflow")
        tensorflow.config.list_physical_devices("GPU")  # CUDA's start-up (its cuInit) logs here, filtered too


def import_tensorflow_quietly() -> None:
    """`import_tensorflow` in a process that `petal` did not start (a benchmark), where nothing has set
    TF_CPP_MIN_LOG_LEVEL: at 2 unless the environment says otherwise (errors show; 0 shows everything), the level
    load_tests.launcher gives the servers such a process starts, and which its children inherit."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import_tensorflow()


def _kept(line: bytes, keep: Callable[[bytes], bool]) -> bytes:
    return line + b"\n" if keep(line) else b""


@contextlib.contextmanager
def stderr_filtered(keep: Callable[[bytes], bool]) -> Iterator[None]:
    """Within the block, every line written to file descriptor 2 (by Python or C++) reaches it only if `keep`
    says so, as it is written."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # a smaller pipe only means the writer may wait for the filter
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    stderr = os.dup(2)
    relay = threading.Thread(target=relay_lines, args=(read_end, stderr, functools.partial(_kept, keep=keep)),
                             name="petal-stderr-filter", daemon=True)
    relay.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        sys.stderr.flush()
        os.dup2(stderr, 2)  # the pipe's last writer is gone: the relay reads to its end and stops
        # unless child processes hold the pipe too: on Ctrl-C, those still ending are not waited for
        relay.join(timeout=INTERRUPTED_RELAY_S if interrupted else None)
        os.close(stderr)


def relay_lines(read_end: int, out: int, transform: Callable[[bytes], bytes]) -> None:
    """Each line read from `read_end` (without its newline) written to `out` as `transform` makes it, until the
    pipe ends. Written with os.write, not through Python's logging or sys.stderr, whose locks a fork taken while this
    thread held one would leave held in the child. A writer that never ends a line has it written out in pieces."""
    pending = b""
    while chunk := os.read(read_end, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        while len(pending) >= MAX_LINE_BYTES:
            lines.append(pending[:MAX_LINE_BYTES])
            pending = pending[MAX_LINE_BYTES:]
        for line in lines:
            write_all(out, transform(line))
    if pending:
        write_all(out, transform(pending))
    os.close(read_end)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
