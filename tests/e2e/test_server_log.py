"""After its first screen a real `petal serve` writes JSON lines only, whoever writes them (docs/serving.md, 'The
first screen'): TensorFlow's C++ in a worker, on a corrupt JPEG a client sent; a worker's last words as it crashes
(Python's faulthandler, which each worker turns on, on a worker sent SIGSEGV), read by the master after the worker is
gone; gunicorn's master saying what killed the worker. Until then the first and the last were plain text among the
JSON, and a crashed worker said nothing."""
from __future__ import annotations

import json
import os
import signal
import struct
import time
import zlib

import requests

from server_harness import b64, jpeg, run_server, tiny_model_base, worker_pid
from training.synth import render

WAIT_S = 120


def corrupt_jpegs() -> list[bytes]:
    """A flower photo cut short at 26 places: each is a 400, and TensorFlow's decoder logs an error line for it."""
    photo = render("roses", 7)
    return [photo[:cut] for cut in range(len(photo) // 3, len(photo) - 100, len(photo) // 40)]


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels in a few dozen bytes: its size is read, and it is refused, before
    anything decodes it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def records(log: str) -> list[dict]:
    """Every line after the first screen (`petal serve: loading ...`, `ready: ...`), each of which must be a JSON
    object."""
    lines = [line for line in log.splitlines() if not line.startswith(("petal serve: ", "ready: "))]
    return [json.loads(line) for line in lines]


def ready(server) -> bool:
    try:
        return requests.get(f"{server.rest_url}/readyz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_tensorflow_a_crashed_workers_last_words_and_gunicorn_reach_the_log_as_json_records():
    with run_server("--model_name=flowers", f"--model_base_path={tiny_model_base()}") as server:
        url = f"{server.rest_url}/v1/models/flowers:predict"
        statuses = {requests.post(url, json={"instances": [b64(body)]}, timeout=60).status_code
                    for body in corrupt_jpegs()}
        assert statuses == {400}
        for pixels in (10_000 * 10_000, 10_000 * 20_000):  # past Pillow's own bomb limit, and past twice it
            response = requests.post(url, json={"instances": [b64(png_header(10_000, pixels // 10_000))]}, timeout=60)
            assert response.status_code == 400 and f"Image too large: {pixels} pixels" in response.json()["error"]
        first = worker_pid(server.proc.pid)
        os.kill(first, signal.SIGSEGV)
        deadline = time.monotonic() + WAIT_S
        while not any(r["logger"] == "gunicorn.error" and str(first) in r["msg"] for r in records(server.log())):
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        while not ready(server):  # the one worker's replacement boots: until it listens, connections wait
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        assert requests.post(url, json={"instances": [b64(jpeg())]}, timeout=60).status_code == 200
        logged = records(server.log())
    killed = [r for r in logged if r["logger"] == "gunicorn.error"]
    assert [r["msg"] for r in killed] == [f"Worker (pid:{first}) was sent SIGSEGV!"], killed
    assert killed[0]["level"] in ("WARNING", "ERROR")  # gunicorn's choice: 27 says ERROR only for SIGKILL
    last_words = [r for r in logged if r["logger"] == "petal.worker.stderr" and r["pid"] == first
                  and r["msg"] == "Fatal Python error: Segmentation fault"]
    assert [r["level"] for r in last_words] == ["CRITICAL"], logged
    stacks = [r for r in logged if r.get("pid") == first and r["msg"].startswith("File ")]  # the stacks themselves
    assert stacks and {r["level"] for r in stacks} == {"WARNING"}, logged
    # TensorFlow's own line for each corrupt JPEG (TF_CPP_MIN_LOG_LEVEL is 2 here: errors show), at absl's level
    assert not [r for r in logged if "DecompressionBomb" in r["msg"] or "warnings.warn" in r["msg"]], logged
    tensorflow = [r for r in logged if r["logger"] == "petal.worker.stderr" and "jpeg_mem.cc" in r["msg"]]
    assert tensorflow and {(r["level"], r["pid"]) for r in tensorflow} == {("ERROR", first)}, logged
