"""Start `petal serve` as a real gunicorn subprocess on free loopback ports, for every protocol's tests.

Also builds the tiny test model once per test process (an untrained "compact" 32 px classifier exported with the
training API), so protocol tests exercise a real SavedModel without paying for training.
"""
from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from serving.core import DataPlane

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
IMAGE_SIZE = 32
STARTUP_TIMEOUT_S = 180


@dataclass
class Server:
    rest_url: str
    grpc_target: str
    rest_port: int
    grpc_port: int  # 0 when the ARGS gave --port
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Distinct free ports: every socket stays bound until all are chosen."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def b64(data: bytes) -> dict:
    """A REST predict instance value: TF Serving's {"b64": ...} for binary strings."""
    return {"b64": base64.b64encode(data).decode()}


def get_status(url: str, context: ssl.SSLContext | None = None) -> int:
    """The HTTP status of a GET, or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def _has_flag(args: tuple[str, ...], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _flag_value(args: tuple[str, ...], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(name + "=")), None)


@contextmanager
def run_server(*petal_serve_args: str, env: dict[str, str] | None = None, wait_ready: bool = True,
               stop_timeout: float = 60.0, tls_context: ssl.SSLContext | None = None) -> Iterator[Server]:
    """`petal serve ARGS` on free ports; yields once /readyz is 200 (or /healthz, with wait_ready=False).

    It binds 127.0.0.1 unless ARGS say `--host=ADDRESS` (another loopback address, say), and the URLs follow.
    With `tls_context` (for a server given --ssl_config_file) the REST URL is https and the probe uses it.
    """
    args = tuple(petal_serve_args)
    host = _flag_value(args, "--host") or "127.0.0.1"
    rest_port = free_port()
    grpc_port = 0 if _has_flag(args, "--port") else free_port()
    extra = [f"--host={host}", f"--rest_api_port={rest_port}"]
    if grpc_port:
        extra.append(f"--port={grpc_port}")
    log_file = tempfile.NamedTemporaryFile(prefix="petal-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "petal", "serve", *extra, *args], cwd=ROOT,
                            stdout=log_file, stderr=subprocess.STDOUT,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    scheme = "https" if tls_context else "http"
    server = Server(f"{scheme}://{host}:{rest_port}", f"{host}:{grpc_port}", rest_port, grpc_port, proc,
                    log_file.name)
    try:
        probe = server.rest_url + ("/readyz" if wait_ready else "/healthz")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while get_status(probe, tls_context) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"petal serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"petal serve not ready after {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_file.close()
        os.unlink(log_file.name)


@contextmanager
def in_process_core(**options: object) -> Iterator["DataPlane"]:
    """A real DataPlane in this process, its models loaded (no server, no polling): the in-process tests of every
    protocol call it through Flask's test client or a gRPC servicer."""
    from serving.config import DataPlaneOptions
    from serving.core import DataPlane

    core = DataPlane.create(DataPlaneOptions(file_system_poll_wait_seconds=0, **options))
    try:
        core.wait_loaded()
        assert core.ready(), "the models did not load"
        yield core
    finally:
        core.close()


def jpeg(size: int = IMAGE_SIZE, seed: int = 0, quality: int = 90) -> bytes:
    """A real JPEG with some structure (so different seeds give different predictions)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((size, size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


_model_base: str | None = None


def tiny_model_base() -> str:
    """A base path holding version 1 of the tiny test model, exported once per process (copy it, don't edit)."""
    global _model_base
    if _model_base is None:
        from training.export import export_saved_model
        from training.models import build_model

        base = os.path.join(tempfile.mkdtemp(prefix="petal-test-model-"), "flowers")
        model = build_model("compact", len(LABELS), IMAGE_SIZE)
        export_saved_model(model, base, LABELS, IMAGE_SIZE, version=1,
                           warmup_images=[jpeg(seed=s) for s in range(3)])
        _model_base = base
    return _model_base


def copy_model(dest_base: str, version: int, source_version: int = 1) -> str:
    """Publish a copy of the tiny model as `dest_base/version` in one rename, as an exporter would."""
    os.makedirs(dest_base, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=dest_base)
    shutil.copytree(os.path.join(tiny_model_base(), str(source_version)), os.path.join(staging, "v"))
    final = os.path.join(dest_base, str(version))
    os.rename(os.path.join(staging, "v"), final)
    os.rmdir(staging)
    return final


@contextmanager
def run_batching_server(root, batching_config: str, *petal_serve_args: str) -> Iterator[Server]:
    """The tiny model as version 1 under `root`, served with a text-format BatchingParameters file."""
    copy_model(os.path.join(root, "flowers"), 1)
    batching = os.path.join(root, "batching.config")
    with open(batching, "w") as f:
        f.write(batching_config)
    with run_server(f"--model_base_path={os.path.join(root, 'flowers')}", f"--batching_parameters_file={batching}",
                    "--port=0", *petal_serve_args) as server:
        yield server


# --- memory -----------------------------------------------------------------------------------------------

def flat_jpeg(side: int) -> bytes:
    """A flat-colour JPEG: about 0.56 MB on the wire at 6000 x 6000, and 3 bytes a pixel once decoded."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 120, 40)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Start VmHWM again from the current size, so the peak is the flood's and not the model load's."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def worker_pid(master: int) -> int:
    """The first gunicorn worker of a `petal serve` master."""
    return int(subprocess.check_output(["pgrep", "-P", str(master)]).split()[0])
