"""load_tests.launcher, the one way `petal loadtest`, the tests and the benchmarks start `petal serve`: distinct ports,
a clear error with the log's tail when the server does not come up, and a stop that SIGKILL bounds."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from load_tests import launcher
from server_harness import ROOT, tiny_model_base


def logged_path(error: launcher.ServerStartError) -> str:
    match = re.search(r"; log (\S+):\n", str(error))
    assert match, str(error)
    return match[1]


def test_a_server_that_exits_is_an_error_with_its_log_tail():
    with pytest.raises(launcher.ServerStartError) as caught:
        with launcher.running(["--no_such_flag"], cwd=ROOT, timeout_s=120):
            pytest.fail("a server with an unknown flag came up")
    message = str(caught.value)
    assert message.startswith("`petal serve` exited with code 2; log ")
    assert "unrecognized arguments: --no_such_flag" in message  # argparse's complaint, from the server's log
    assert not os.path.exists(logged_path(caught.value))  # the temporary log is removed with the server


def test_a_server_not_ready_in_time_is_an_error_and_is_stopped(tmp_path):
    log_path = str(tmp_path / "server.log")
    server = launcher.start(["--model_name=flowers", f"--model_base_path={tiny_model_base()}"], log_path, cwd=ROOT)
    try:
        with pytest.raises(launcher.ServerStartError, match=r"^`petal serve` not ready after 0\.2s; log "):
            launcher.wait_ready(server, lambda _: False, timeout_s=0.2)
    finally:
        launcher.stop(server, timeout_s=30)
    assert server.proc.returncode is not None
    assert os.path.exists(log_path)  # a log the caller named is the caller's to keep


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                             " print('ignoring', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ignoring\n"
    server = launcher.Server("http://127.0.0.1:1", "127.0.0.1:1", 1, 1, proc, str(tmp_path / "log"))
    started = time.monotonic()
    launcher.stop(server, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()


def test_a_real_server_is_ready_on_two_distinct_ports_and_gone_after():
    with launcher.running([f"--model_base_path={tiny_model_base()}", "--model_name=flowers"], cwd=ROOT) as server:
        assert server.rest_port != server.grpc_port
        assert server.rest_url == f"http://127.0.0.1:{server.rest_port}"
        assert launcher.get_status(server.rest_url + "/readyz") == 200
        with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10):
            pass
        log_path = server.log_path
        assert os.path.exists(log_path)
    assert server.proc.returncode == 0  # SIGTERM: a clean drain
    assert not os.path.exists(log_path)
