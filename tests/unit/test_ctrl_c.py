"""A batch job's Ctrl-C seen at once from any thread: its Beam workers get the same signal and print their
tracebacks through the job's stderr filter, which has to know of the Ctrl-C before the main thread's Python handler
runs (that waits for the main thread to come back from C)."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from serving.batch_prediction.cli import CtrlC, stopped_by_ctrl_c

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_ctrl_c_is_seen_from_another_thread_while_the_main_thread_is_still_in_c():
    assert threading.current_thread() is threading.main_thread()
    times: dict[str, float] = {}
    into_c = threading.Event()

    def send_and_watch(ctrl_c: CtrlC) -> None:
        into_c.wait()
        time.sleep(0.05)  # the main thread is in C by now, for a second or more
        assert not ctrl_c.is_set()
        times["sent"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # long taken by the main thread's C-level handler, no longer pending: the wakeup fd tells
        while not ctrl_c.is_set() and time.monotonic() < times["sent"] + 30:
            time.sleep(0.001)
        times["seen"] = time.monotonic()

    handler_before = signal.getsignal(signal.SIGINT)  # pytest's, or SIG_IGN in a shell's background job (CI)
    with CtrlC() as ctrl_c, pytest.raises(KeyboardInterrupt), stopped_by_ctrl_c(ctrl_c):
        watcher = threading.Thread(target=send_and_watch, args=(ctrl_c,))
        watcher.start()
        into_c.set()
        # in C without the GIL, and without a check for signals: the Python handler waits for it to return
        hashlib.pbkdf2_hmac("sha256", b"petal", b"salt", 3_000_000)
    times["raised"] = time.monotonic()
    watcher.join()
    assert times["seen"] - times["sent"] < (times["raised"] - times["sent"]) / 4, times
    assert signal.getsignal(signal.SIGINT) == handler_before  # put back
    assert signal.set_wakeup_fd(-1) == -1


def test_a_ctrl_c_no_thread_has_taken_yet_is_seen():
    """Pending: the kernel holds it for the process until one of its threads runs (on a loaded machine the Beam
    workers can run first). Every thread blocks SIGINT to keep it pending: the mask is set before TensorFlow's
    threads start, which take it from the thread that starts them."""
    script = ("import os, signal\n"
              "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
              "from serving.batch_prediction.cli import CtrlC\n"
              "with CtrlC() as ctrl_c:\n"
              "    before = ctrl_c.is_set()\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    print(before, ctrl_c.is_set(), signal.SIGINT in signal.sigpending())\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True", "True"], done.stderr[-2000:]
