"""Petal's serving speed against the in-process limit and a naive Flask baseline (SPEC §8).

    .venv/bin/python benchmarks/serving.py [--model_base_path exported_models/flowers] [--duration 8]

1. The limit: the exported `serving_default` signature called in this process on pre-encoded JPEG batches
   (best images/s over batch sizes), and its single-image latency.
2. Petal (`petal serve`, defaults) and the baseline (benchmarks/naive_flask.py) each get a separate load-generator
   process on loopback: closed loop, keep-alive connections, fixed concurrency, warmup, then a fixed duration,
   sending the same TF Serving predict body ({"instances": [{"b64": JPEG}]}).
3. The load generator is checked not to be the bottleneck: its own CPU use is reported, and it is run against a
   trivial endpoint (/healthz) to show its ceiling is far above the rates measured.
Everything runs side by side in one run, so the ratios hold even though absolute times on a shared machine do not.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
PREDICT_PATH = "/v1/models/flowers:predict"


# --- load generator (runs in its own process) -----------------------------------------------------------------

def loadgen(port: int, path: str, body: bytes, concurrency: int, duration: float, warmup: float) -> dict:
    """Closed loop: each thread sends its next request when the previous answer arrives."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start_at = time.monotonic() + warmup
    stop_at = start_at + duration
    method = "POST" if body else "GET"
    headers = {"Content-Type": "application/json"} if body else {}

    def worker(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            sent = time.monotonic()
            if sent >= stop_at:
                break
            try:
                conn.request(method, path, body=body or None, headers=headers)
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                ok = False
            done = time.monotonic()
            if sent >= start_at and done <= stop_at:
                latencies[i].append(done - sent)
                errors[i] += not ok
        conn.close()

    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    flat = np.array([x for per in latencies for x in per]) * 1000
    return {"requests": int(flat.size), "errors": int(sum(errors)), "rps": flat.size / duration,
            "p50": float(np.percentile(flat, 50)) if flat.size else float("nan"),
            "p95": float(np.percentile(flat, 95)) if flat.size else float("nan"),
            "p99": float(np.percentile(flat, 99)) if flat.size else float("nan"),
            "loadgen_cpu_per_request_ms": 1000 * cpu / max(1, flat.size),
            "loadgen_cpu_share": cpu / (duration + warmup)}


def run_loadgen(port: int, path: str, body: bytes, concurrency: int, duration: float, warmup: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        f.write(body)
    try:
        out = subprocess.run([sys.executable, __file__, "--_loadgen", str(port), path, f.name, str(concurrency),
                              str(duration), str(warmup)], check=True, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout)


# --- the in-process limit -------------------------------------------------------------------------------------

def in_process_limit(model_dir: str, image: bytes, seconds: float) -> tuple[float, int, float]:
    """(best images/s, at batch size, single-image p50 ms) calling the signature directly."""
    import tensorflow as tf

    signature = tf.saved_model.load(model_dir).signatures["serving_default"]
    best, best_size = 0.0, 1
    for size in (1, 8, 16, 32, 64):
        batch = tf.constant([image] * size)
        signature(image_bytes=batch)
        count, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            signature(image_bytes=batch)
            count += size
        rate = count / (time.monotonic() - started)
        if rate > best:
            best, best_size = rate, size
    single = tf.constant([image])
    times = []
    for _ in range(300):
        started = time.monotonic()
        signature(image_bytes=single)["probabilities"].numpy()
        times.append(time.monotonic() - started)
    return best, best_size, float(np.percentile(times, 50) * 1000)


# --- servers --------------------------------------------------------------------------------------------------

def start_baseline(model_dir: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "naive_flask.py"), model_dir,
                             str(port)], env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("baseline did not start")


def default_model(image_size: int) -> str:
    """The shipped model when it exists; otherwise an untrained "compact" model exported to a temp dir."""
    base = os.path.join(ROOT, "exported_models", "flowers")
    versions = sorted(int(v) for v in os.listdir(base) if v.isdigit()) if os.path.isdir(base) else []
    if versions:
        return base
    from training.export import export_saved_model
    from training.models import build_model

    base = os.path.join(tempfile.mkdtemp(prefix="petal-bench-"), "flowers")
    export_saved_model(build_model("compact", 5, image_size), base,
                       ["daisy", "dandelion", "roses", "sunflowers", "tulips"], image_size, version=1)
    return base


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_loadgen":
        port, path, body_file, concurrency, duration, warmup = sys.argv[2:8]
        with open(body_file, "rb") as f:
            body = f.read()
        print(json.dumps(loadgen(int(port), path, body, int(concurrency), float(duration), float(warmup))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_base_path", default=None, help="default: exported_models/flowers")
    parser.add_argument("--image_size", type=int, default=64, help="JPEG side (and model size if none shipped)")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from server_harness import free_port, jpeg, run_server

    base = args.model_base_path or default_model(args.image_size)
    version = max(int(v) for v in os.listdir(base) if v.isdigit())
    model_dir = os.path.join(base, str(version))
    image = jpeg(args.image_size, seed=1)
    body = json.dumps({"instances": [{"b64": base64.b64encode(image).decode()}]}).encode()
    levels = [int(c) for c in args.concurrency.split(",")]

    print(f"model {model_dir}, {len(image)} byte JPEG, {os.cpu_count()} cores", flush=True)
    limit, limit_batch, single_ms = in_process_limit(model_dir, image, seconds=2.0)
    print(f"in-process limit: {limit:.0f} images/s (batch {limit_batch}); single image p50 {single_ms:.2f} ms",
          flush=True)

    results: dict[str, dict[int, dict]] = {"petal": {}, "baseline": {}}
    with run_server(f"--model_base_path={base}", "--port=0") as server:
        port = int(server.rest_url.rsplit(":", 1)[1])
        ceiling = run_loadgen(port, "/healthz", b"", 16, args.duration / 2, 1.0)
        for c in levels:
            results["petal"][c] = run_loadgen(port, PREDICT_PATH, body, c, args.duration, args.warmup)
            print(f"petal    c={c:<3} {results['petal'][c]}", flush=True)
    baseline_port = free_port()
    proc = start_baseline(model_dir, baseline_port)
    try:
        for c in levels:
            results["baseline"][c] = run_loadgen(baseline_port, PREDICT_PATH, body, c, args.duration, args.warmup)
            print(f"baseline c={c:<3} {results['baseline'][c]}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)

    print()
    print("| concurrency | Petal img/s | p50 / p95 / p99 ms | baseline img/s | p50 / p95 / p99 ms | Petal / limit "
          "| Petal / baseline |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        p, b = results["petal"][c], results["baseline"][c]
        print(f"| {c} | {p['rps']:.0f} | {p['p50']:.1f} / {p['p95']:.1f} / {p['p99']:.1f} | {b['rps']:.0f} | "
              f"{b['p50']:.1f} / {b['p95']:.1f} / {b['p99']:.1f} | {p['rps'] / limit:.2f} | "
              f"{p['rps'] / max(b['rps'], 1e-9):.2f} |")
    overhead = results["petal"][levels[0]]["p50"] - single_ms
    print(f"\nin-process limit {limit:.0f} images/s (batch {limit_batch}); single-image latency {single_ms:.2f} ms; "
          f"Petal p50 overhead at concurrency {levels[0]}: {overhead:.2f} ms")
    busiest = results["petal"][levels[-1]]
    print(f"load generator: ceiling {ceiling['rps']:.0f} req/s on /healthz at concurrency 16; "
          f"{busiest['loadgen_cpu_per_request_ms']:.2f} ms CPU per request "
          f"({busiest['loadgen_cpu_share']:.0%} of one core) at concurrency {levels[-1]}")
    errors = sum(r["errors"] for per in results.values() for r in per.values())
    print(f"errors: {errors}")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
