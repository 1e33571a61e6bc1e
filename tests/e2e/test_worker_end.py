"""A worker's end is the worker's alone (serving/server.py, `_end_worker`). gunicorn forks a worker inside the
master's `run()` and ends it with sys.exit, which came out of `run()` in the worker too: the worker ran the
master's clean-up, deleting the server's private folder (the TLS key pair, the shared metrics) while the master went
on, so a TLS server whose worker was replaced served no more; and the interpreter's finalization met TensorFlow's
threads still running, so a server stopped while it loaded its model logged a C++ abort.
"""
from __future__ import annotations

import os
import signal
import ssl
import time
import urllib.request

from server_harness import ROOT, children, copy_model, run_server
from serving import launcher
from tls_certs import make_pki

ABORT_SIGNS = ("terminate called", "SIGABRT", "exception not rethrown")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return result


def ready(url: str, context: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5, context=context) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_a_tls_server_whose_worker_is_replaced_serves_again_from_the_new_worker(tmp_path):
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "ssl").write_text(pki.ssl_config())
    copy_model(str(tmp_path / "flowers"), 1)
    context = pki.client_context()
    with run_server(f"--model_base_path={tmp_path / 'flowers'}", f"--ssl_config_file={tmp_path / 'ssl'}",
                    tls_context=context) as server:
        (old,) = children(server.proc.pid)
        os.kill(old, signal.SIGTERM)  # its drain and exit, as gunicorn ends a worker it replaces
        wait_for(lambda: children(server.proc.pid) not in ([], [old]), 60, "no new worker was forked")
        wait_for(lambda: ready(server.rest_url, context), 120, "the new worker never served:\n" + server.log())
        assert server.proc.poll() is None
        assert not [line for line in server.log().splitlines() if any(sign in line for sign in ABORT_SIGNS)]


def test_a_server_stopped_while_its_worker_loads_exits_0_without_an_abort(tmp_path):
    server = launcher.start([f"--model_base_path={ROOT}/exported_models/flowers"], str(tmp_path / "server.log"),
                            cwd=ROOT)
    try:
        wait_for(lambda: children(server.proc.pid) or server.proc.poll() is not None, 60, "no worker was forked")
        time.sleep(1.0)  # the worker is importing TensorFlow or loading the model
        assert "ready:" not in server.log(), "loaded too soon to be stopped while loading"
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log()
        assert not [line for line in server.log().splitlines() if any(sign in line for sign in ABORT_SIGNS)], \
            server.log()
    finally:
        launcher.stop(server, timeout_s=1)
