"""What a newcomer sees first (docs/serving.md, "The first screen"): a real `petal serve` with the default flags
but its ports (the default model), in an environment that sets nothing for TensorFlow, says what it loads and then
that it is ready, and shows none of TensorFlow's C++ start-up lines; `petal --verbose` brings them back. `petal
predict`, `petal batch` and `petal train`, which import TensorFlow themselves, are as quiet, and so are the
benchmarks. Quiet whatever TF_CPP_MIN_LOG_LEVEL says but 0: unset, `petal` sets 3 and a benchmark 2; 0 asks for
every line, as `petal --verbose` does (serving/tensorflow_logs.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from load_tests import launcher
from server_harness import ROOT, TF_NATIVE_LOG, children, free_ports, jpeg, run_server, user_environment
from serving.options.config import ProtocolOptions
from serving.process import ports
from training_data import train_args

# Lines TensorFlow 2.21's C++ prints on a machine without a GPU: at import (the first three, twice; oneDNN's only on
# a CPU with AVX-512), and once its runtime starts (the last two, which TF_CPP_MIN_LOG_LEVEL hides).
TF_LINES = ("All log messages before absl::InitializeLog() is called", "oneDNN custom operations are on",
            "cudart_stub.cc", "cpu_feature_guard.cc", "cuda_platform.cc")
READY_WAIT_S = 240


def first_screen(*petal_options: str, env: dict[str, str] | None = None) -> tuple[list[str], list[str], int]:
    """`petal [OPTIONS] serve` on free loopback ports: the lines it printed until it said it was ready (or stopped),
    those it printed once sent SIGTERM, and its exit code."""
    rest, grpc = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "petal", *petal_options, "serve", "--host=127.0.0.1",
                             f"--rest_api_port={rest}", f"--port={grpc}"], cwd=ROOT, env=env or user_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + READY_WAIT_S
    try:
        while not any(line.startswith("ready: ") for line in lines) and proc.poll() is None:
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        before = len(lines)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    screen = [line.rstrip("\n") for line in lines]
    return screen[:before], screen[before:], code


@pytest.fixture(scope="module", params=[None, "2"], ids=["TF_CPP_MIN_LOG_LEVEL unset", "TF_CPP_MIN_LOG_LEVEL=2"])
def quiet(request) -> tuple[list[str], list[str], int]:
    """As many deployments and CI set TF_CPP_MIN_LOG_LEVEL=2, under which TensorFlow writes the failed cuInit of a
    machine with CUDA's libraries and no GPU (this one) as an ERROR line."""
    level = {} if request.param is None else {"TF_CPP_MIN_LOG_LEVEL": request.param}
    return first_screen(env=user_environment(**level))


def test_the_first_screen_says_what_loads_and_then_that_it_is_ready(quiet):
    screen, _, _ = quiet
    assert len(screen) == 2, screen
    assert screen[0].startswith("petal serve: loading flowers from "), screen
    assert re.fullmatch(r"ready: flowers v1 on http://127\.0\.0\.1:\d+ and grpc://127\.0\.0\.1:\d+ in \d+\.\d s",
                        screen[1]), screen


def test_a_second_server_on_the_machine_says_the_same_and_neither_opens_a_control_socket(tmp_path):
    """gunicorn 25.1 and later open a control socket at one path per user unless told not to: a second server
    took the first's path over (and removed it when it stopped), or, starting at the same moment, said on its first
    screen that the address was in use."""
    home, runtime = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    runtime.mkdir()
    env = user_environment(HOME=str(home), XDG_RUNTIME_DIR=str(runtime))

    def sockets() -> list[str]:
        return sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_socket())
    with run_server(env=env):
        assert sockets() == []
        screen, _, code = first_screen(env=env)
    assert len(screen) == 2 and screen[1].startswith("ready: "), screen
    assert code == 0


def test_no_tensorflow_start_up_line_and_a_quiet_exit(quiet):
    screen, after_sigterm, code = quiet
    assert not [line for line in screen + after_sigterm if any(tf in line for tf in TF_LINES)]
    assert after_sigterm == [] and code == 0


def test_verbose_brings_tensorflows_lines_back():
    screen, _, _ = first_screen("--verbose")
    # absl's notice, then TensorFlow's C++ log lines (which ones depends on the CPU: oneDNN's only with AVX-512), each
    # a worker's line that the master writes out as a JSON record (serving/process/worker_stderr.py) at absl's level.
    native = [entry for entry in map(json.loads, (line for line in screen if line.startswith("{")))
              if entry["logger"] == "petal.worker.stderr"]
    assert any(TF_LINES[0] in entry["msg"] for entry in native), screen
    assert any(TF_NATIVE_LOG.match(entry["msg"]) and entry["level"] == "INFO" for entry in native), screen
    assert any(line.startswith("ready: flowers v1 on ") for line in screen)


BATCH_JOB = ["batch", "--model_dir", "exported_models/flowers", "--input", "IMAGE", "--output_dir", "OUT"]
TRAIN_JOB = ["train", "TINY_SET"]  # one step on tests/training_data.py's tiny set, with its export


def quiet_run(command: list[str], level: str | None) -> None:
    """`python COMMAND` from the checkout, in a user's environment with TF_CPP_MIN_LOG_LEVEL unset or at `level`:
    it succeeds and prints nothing to stderr."""
    env = user_environment(**({} if level is None else {"TF_CPP_MIN_LOG_LEVEL": level}))
    run = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr


@pytest.mark.parametrize(("command", "level"), [
    (["predict", "IMAGE"], None), (["batch", "--help"], None), (["tfrecords", "--help"], None),
    (["train", "--help"], None), (["export", "--help"], None), (BATCH_JOB, None),
    (["predict", "IMAGE"], "2"), (BATCH_JOB, "2"), (TRAIN_JOB, "2")])
def test_commands_that_import_tensorflow_do_so_quietly(command, level, tmp_path, request):
    """A whole Beam job too: Beam 2.77's RunInference warned, on every model load, that it could not measure memory.
    The training commands printed TensorFlow's C++ start-up lines twice, and `tfrecords` Beam's warning about Google
    Cloud clients, even for --help. With TF_CPP_MIN_LOG_LEVEL=2 the commands that run a model printed the failed
    cuInit of a machine without a GPU as an ERROR line; unset, `petal` sets 3, which a real job needs no more than
    --help does."""
    image = tmp_path / "flower.jpg"
    image.write_bytes(jpeg())
    paths = {"IMAGE": str(image), "OUT": str(tmp_path / "out")}
    if command == TRAIN_JOB:
        command = train_args(request.getfixturevalue("tiny_data"), tmp_path / "out", "--train_steps", "1")[1:]
    quiet_run(["-m", "petal", *[paths.get(a, a) for a in command]], level)


@pytest.mark.parametrize(("benchmark", "level"), [
    (["batch.py", "--help"], None), (["train_throughput.py", "--help"], "2"), (["input_pipeline.py", "--help"], None),
    (["session_callable.py", "--rounds", "1", "--calls", "1", "--batches", "1"], "2")],
    ids=["batch", "train_throughput", "input_pipeline", "session_callable"])
def test_benchmarks_import_tensorflow_quietly(benchmark, level):
    """The first three import TensorFlow as they are loaded, so --help is their whole start: they printed absl's
    notice and "Could not find cuda drivers" twice (and, with TF_CPP_MIN_LOG_LEVEL unset, the CPU instructions
    notice), and input_pipeline.py Beam's warning that apitools was not found. Every benchmark imports TensorFlow the
    one way (serving/tensorflow_logs.py's import_tensorflow_quietly). session_callable.py, in one short round,
    printed TensorFlow's notices that TF1's API is deprecated, for the model it builds and as it loads it."""
    quiet_run([f"benchmarks/{benchmark[0]}", *benchmark[1:]], level)


def test_a_second_server_on_the_first_ones_ports_says_so_at_once_and_exits():
    """gRPC binds with SO_REUSEPORT (the workers share --port): unchecked, a second server on the first's --port
    started, said it was ready, and took half of the first's gRPC connections; on its REST port gunicorn retried for
    5 s, then exited 1 after ten log lines."""
    with run_server("--host=127.0.0.1") as first:
        (other,) = free_ports(1)
        for flags, said in ((["--rest_api_port", str(other), "--port", str(first.grpc_port)],
                             [f"petal serve: the gRPC port 127.0.0.1:{first.grpc_port} is in use (another server "
                              "listens there); give --port another port"]),
                            (["--rest_api_port", str(first.rest_port), "--port", str(first.grpc_port)],
                             [f"petal serve: the REST port 127.0.0.1:{first.rest_port} is in use (another server "
                              "listens there); give --rest_api_port another port",
                              f"petal serve: the gRPC port 127.0.0.1:{first.grpc_port} is in use (another server "
                              "listens there); give --port another port"])):
            second = subprocess.run([sys.executable, "-m", "petal", "serve", "--host=127.0.0.1", *flags], cwd=ROOT,
                                    env=user_environment(), capture_output=True, text=True, timeout=60)
            # these lines alone: not the banner, which comes before anything loads
            assert (second.returncode, second.stderr.splitlines(), second.stdout) == (2, said, "")
        with urllib.request.urlopen(f"{first.rest_url}/readyz", timeout=10) as answer:
            assert answer.status == 200


def test_a_second_server_on_the_port_of_one_still_loading_says_so_at_once_and_exits(tmp_path):
    """A server's workers bind --port only once their models have loaded, so a listener check alone let a second
    server, started meanwhile on that --port with another REST port, start too: both said they were ready and
    shared the port's connections, each serving its own models (seen with two default servers started a second
    apart). Here the first one's worker is stopped (SIGSTOP) as it is forked, long before it could bind."""
    first = launcher.start(["--host=127.0.0.1"], str(tmp_path / "first.log"), cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not children(first.proc.pid) and first.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        (worker,) = children(first.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        (other,) = free_ports(1)
        second = subprocess.run([sys.executable, "-m", "petal", "serve", "--host=127.0.0.1",
                                 f"--rest_api_port={other}", f"--port={first.grpc_port}"], cwd=ROOT,
                                env=user_environment(), capture_output=True, text=True, timeout=60)
        os.kill(worker, signal.SIGCONT)
        assert (second.returncode, second.stderr.splitlines(), second.stdout) == (2, [
            f"petal serve: the gRPC port 127.0.0.1:{first.grpc_port} is taken by another petal serve that is still "
            "loading its models; give --port another port"], "")
        assert "is in use" not in first.log()
    finally:
        launcher.stop(first, timeout_s=60)
    # the claim went with the server, which on a busy machine may end with its worker still loading, after the master
    deadline = time.monotonic() + 120
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    claim, _ = ports.claim_grpc_port(ProtocolOptions(port=first.grpc_port))
    assert claim is not None
    claim.close()
