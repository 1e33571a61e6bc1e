"""A worker's end is the worker's alone (serving/process/server.py, `_end_worker`). gunicorn forks a worker inside the
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

import pytest

from load_tests import launcher
from server_harness import ROOT, children, copy_model, run_server
from tls_certs import make_pki

ABORT_SIGNS = ("terminate called", "SIGABRT", "exception not rethrown")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return result


def ready(url: str, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5, context=context) as answer:
            return answer.status == 200
    except OSError:
        return False


def request_count(url: str, context: ssl.SSLContext | None) -> float:
    """TF Serving's request counter for the model status API, summed over the workers."""
    with urllib.request.urlopen(f"{url}/monitoring/prometheus/metrics", timeout=10, context=context) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(":tensorflow:serving:request_count{") and 'entrypoint="REST"' in line)


@pytest.mark.parametrize("flags", [["--ssl_config_file=SSL"], ["--workers=2"]], ids=["tls", "two-workers"])
def test_a_server_whose_worker_is_replaced_serves_on_from_the_new_worker(flags, tmp_path):
    """Before, the replacement of a TLS server never served, and one of two workers failed to boot (its metrics
    folder gone), which stopped the server."""
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "ssl").write_text(pki.ssl_config())
    copy_model(str(tmp_path / "flowers"), 1)
    tls = flags == ["--ssl_config_file=SSL"]
    context = pki.client_context() if tls else None
    flags = [f.replace("SSL", str(tmp_path / "ssl")) for f in flags]
    with run_server("--model_name=flowers", f"--model_base_path={tmp_path / 'flowers'}", *flags,
                    tls_context=context) as server:
        for _ in range(5):
            urllib.request.urlopen(f"{server.rest_url}/v1/models/flowers", timeout=10, context=context).close()
        counted = request_count(server.rest_url, context)
        old, *others = children(server.proc.pid)
        os.kill(old, signal.SIGTERM)  # its drain and exit, as gunicorn ends a worker it replaces
        wait_for(lambda: (now := children(server.proc.pid)) and old not in now and len(now) == 1 + len(others),
                 60, "no new worker was forked:\n" + server.log())
        wait_for(lambda: ready(server.rest_url, context), 120, "the new worker never served:\n" + server.log())
        assert server.proc.poll() is None
        assert request_count(server.rest_url, context) >= counted  # what the old worker counted still counts
        assert not [line for line in server.log().splitlines() if any(sign in line for sign in ABORT_SIGNS)]


def test_a_server_stopped_while_its_worker_loads_exits_0_without_an_abort(tmp_path):
    server = launcher.start(["--model_name=flowers", f"--model_base_path={ROOT}/exported_models/flowers"],
                            str(tmp_path / "server.log"), cwd=ROOT)
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
