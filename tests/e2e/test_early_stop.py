"""A `petal serve` stopped while its worker is still starting stops at once (docs/deploy.md, 'Shutdown': a pod deleted
while it starts). gunicorn's master forks the worker, which keeps the master's signal handlers until it installs its
own: a SIGTERM the master passes on in between went to a copy of the master's queue and was lost, and the worker
went on to load its model and serve until the master's --graceful_timeout ran out and it was killed, 30 seconds by
default.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from load_tests import launcher
from server_harness import ROOT, children, tiny_model_base


def test_a_sigterm_as_the_worker_is_forked_stops_the_server_at_once(tmp_path):
    base = tiny_model_base()
    for attempt in range(3):
        server = launcher.start(["--model_name=flowers",
                                 f"--model_base_path={base}"], str(tmp_path / f"server-{attempt}.log"), cwd=ROOT)
        try:
            deadline = time.monotonic() + 60
            while not children(server.proc.pid) and server.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)  # the worker is forked after the master has bound the REST port
            assert children(server.proc.pid), "no worker was forked"
            os.kill(server.proc.pid, signal.SIGTERM)
            stopped = time.monotonic()
            returncode = server.proc.wait(timeout=25)
            assert time.monotonic() - stopped < 10, f"stopped after {time.monotonic() - stopped:.1f} s"
            assert returncode == 0, (returncode, server.log())
            assert "ready:" not in server.log(), "the worker went on to serve after the server was told to stop"
        except subprocess.TimeoutExpired:
            raise AssertionError("the server did not stop within 25 s of SIGTERM") from None
        finally:
            launcher.stop(server, timeout_s=1)
