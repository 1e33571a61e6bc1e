"""Petal's serving speed against the in-process limit and a naive Flask baseline (SPEC §8), per protocol.

    .venv/bin/python benchmarks/serving.py [--model_base_path exported_models/flowers] [--duration 4]

1. The images are what users send: synthetic flower photos from training.synth.render, 480x360 JPEGs (the
   primary table), and 64x64 thumbnails (so the case where HTTP overhead dominates is not hidden).
2. The limit: the exported `serving_default` signature called in this process on batches of the same JPEGs
   (best images/s over batch sizes, called by one thread or by one per core), and its single-image latency.
3. Petal (`petal serve`, defaults) is driven over REST predict ({"instances": [{"b64": JPEG}]}), gRPC Predict
   (a DT_STRING TensorProto, the way TF Serving's example clients send it) and KServe V2 infer with Triton's
   binary BYTES extension; the baseline (benchmarks/naive_flask.py) gets the same REST body. Each run is a
   separate load-generator process on loopback: closed loop, one connection per client, fixed concurrency,
   warmup, then a fixed duration, with request bodies built before the clock starts.
4. The load generator is checked not to be the bottleneck: its ceiling on a trivial endpoint (/healthz, gRPC
   health Check) at the same concurrency is printed beside the rates measured, and so is its own CPU per request.
5. CPU is accounted per image (the server's processes from /proc, the load generator's own), which gives the bound
   the cores allow: every image needs the model's best-batch CPU plus at least a trivial request's CPU, client
   included, since both share this machine. A ratio to the limit is read against that bound.
Everything runs side by side in one run, so the ratios hold even though absolute times on a shared machine do not.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import http.client
import json
import os
import pickle
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
MODEL = "flowers"
PREDICT_PATH = f"/v1/models/{MODEL}:predict"
INFER_PATH = f"/v2/models/{MODEL}/infer"
GRPC_PREDICT = "/tensorflow.serving.PredictionService/Predict"
GRPC_HEALTH = "/grpc.health.v1.Health/Check"
PHOTOS = 8  # distinct photos per image set, cycled through by every client
LIMIT_BATCH_SIZES = (1, 8, 16, 32, 64)


# --- load generator (runs in its own process; imports neither TensorFlow nor the server) ----------------------

@dataclasses.dataclass
class Requests:
    """What one load-generator run sends: `bodies` cycled per client, over HTTP (method, path, headers) or gRPC."""
    protocol: str  # "http" or "grpc"
    port: int
    path: str
    bodies: list[bytes]
    headers: dict[str, str]
    server_pid: int  # its CPU time (with its worker processes) is sampled over the measured window


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (gunicorn's master and workers), from /proc."""
    total = 0.0
    for p in [pid] + [int(c) for c in _read(f"/proc/{pid}/task/{pid}/children").split()]:
        fields = _read(f"/proc/{p}/stat").rsplit(")", 1)[-1].split()
        if len(fields) > 12:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _http_client(requests: Requests):
    conn = http.client.HTTPConnection("127.0.0.1", requests.port, timeout=60)
    method = "POST" if requests.bodies[0] else "GET"

    def send(body: bytes) -> bool:
        nonlocal conn
        try:
            conn.request(method, requests.path, body=body or None, headers=requests.headers)
            response = conn.getresponse()
            response.read()
            return response.status == 200
        except OSError:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", requests.port, timeout=60)
            return False
    return send, lambda: conn.close()


def _grpc_client(requests: Requests):
    """Raw bytes in and out (no per-call protobuf work), on a channel of its own, like an independent client."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{requests.port}", options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary(requests.path)

    def send(body: bytes) -> bool:
        try:
            call(body, timeout=60)
            return True
        except grpc.RpcError:
            return False
    return send, channel.close


def loadgen(requests: Requests, concurrency: int, duration: float, warmup: float) -> dict:
    """Closed loop: each client sends its next request when the previous answer arrives."""
    clients = [(_grpc_client if requests.protocol == "grpc" else _http_client)(requests)
               for _ in range(concurrency)]
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start_at = time.monotonic() + warmup
    stop_at = start_at + duration

    def worker(i: int) -> None:
        send, _ = clients[i]
        n = i
        while True:
            sent = time.monotonic()
            if sent >= stop_at:
                break
            ok = send(requests.bodies[n % len(requests.bodies)])
            n += 1
            done = time.monotonic()
            if sent >= start_at and done <= stop_at:
                latencies[i].append(done - sent)
                errors[i] += not ok

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, start_at - time.monotonic()))
    own, server = _self_cpu_seconds(), tree_cpu_seconds(requests.server_pid)
    time.sleep(max(0.0, stop_at - time.monotonic()))
    own, server = _self_cpu_seconds() - own, tree_cpu_seconds(requests.server_pid) - server
    for t in threads:
        t.join()
    for _, close in clients:
        close()
    flat = np.array([x for per in latencies for x in per]) * 1000
    percentile = (lambda q: float(np.percentile(flat, q))) if flat.size else (lambda q: float("nan"))
    return {"requests": int(flat.size), "errors": int(sum(errors)), "rps": flat.size / duration,
            "p50": percentile(50), "p95": percentile(95), "p99": percentile(99),
            "loadgen_cpu_share": own / duration, "loadgen_cpu_ms": 1000 * own / max(1, flat.size),
            "server_cpu_share": server / duration, "server_cpu_ms": 1000 * server / max(1, flat.size)}


def _self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_loadgen(requests: Requests, levels: list[int], duration: float, warmup: float) -> dict[int, dict]:
    """One load-generator process for every concurrency level of one column (so its start-up is paid once)."""
    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
        pickle.dump(dataclasses.asdict(requests), f)  # plain data: the loader need not import this module
    try:
        out = subprocess.run([sys.executable, __file__, "--_loadgen", f.name, ",".join(map(str, levels)),
                              str(duration), str(warmup)], check=True, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return {int(c): r for c, r in json.loads(out.stdout).items()}


def loadgen_main(argv: list[str]) -> int:
    path, levels, duration, warmup = argv
    with open(path, "rb") as f:
        requests = Requests(**pickle.load(f))
    print(json.dumps({c: loadgen(requests, int(c), float(duration), float(warmup)) for c in levels.split(",")}))
    return 0


# --- request bodies, one per photo, per protocol --------------------------------------------------------------

def rest_requests(port: int, pid: int, photos: list[bytes]) -> Requests:
    bodies = [json.dumps({"instances": [{"b64": base64.b64encode(p).decode()}]}).encode() for p in photos]
    return Requests("http", port, PREDICT_PATH, bodies, {"Content-Type": "application/json"}, pid)


def v2_binary_requests(port: int, pid: int, photos: list[bytes]) -> Requests:
    """Triton's binary extension: JSON header, then each BYTES element as a 4-byte little-endian length + data."""
    bodies, lengths = [], set()
    for photo in photos:
        raw = struct.pack("<I", len(photo)) + photo
        header = json.dumps({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()
        bodies.append(header + raw)
        lengths.add(len(header))
    if len(lengths) != 1:  # the header length is a request header, shared by all bodies of a run
        raise ValueError("V2 headers differ in length")
    return Requests("http", port, INFER_PATH, bodies, {"Content-Type": "application/octet-stream",
                                                      "Inference-Header-Content-Length": str(lengths.pop())}, pid)


def grpc_requests(port: int, pid: int, photos: list[bytes]) -> Requests:
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    bodies = []
    for photo in photos:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL
        request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([photo]))
        bodies.append(request.SerializeToString())
    return Requests("grpc", port, GRPC_PREDICT, bodies, {}, pid)


def health_requests(protocol: str, port: int, pid: int) -> Requests:
    if protocol == "grpc":
        return Requests("grpc", port, GRPC_HEALTH, [b""], {}, pid)  # an empty HealthCheckRequest: service ""
    return Requests("http", port, "/healthz", [b""], {}, pid)


# --- the in-process limit -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Limit:
    rate: float  # best images/s
    batch: int  # at this batch size
    callers: int  # with this many threads calling at once
    cpu_ms: float  # CPU per image there
    single_ms: float  # p50 latency of a one-image call


def in_process_limit(model_dir: str, photos: list[bytes], seconds: float) -> Limit:
    """The signature called directly on batches of the same photos, by one thread and by one per core (the
    graph alone may not fill every core, and the server runs a batch per core), and one photo at a time."""
    import tensorflow as tf

    signature = tf.saved_model.load(model_dir).signatures["serving_default"]
    best = Limit(0.0, 1, 1, 0.0, 0.0)
    for size in LIMIT_BATCH_SIZES:
        batches = [tf.constant([photos[(i + j) % len(photos)] for j in range(size)]) for i in range(len(photos))]
        signature(image_bytes=batches[0])
        for callers in sorted({1, os.cpu_count() or 1}):
            counts = [0] * callers
            stop_at = time.monotonic() + seconds

            def call(i: int) -> None:
                while time.monotonic() < stop_at:
                    signature(image_bytes=batches[(counts[i] // size + i) % len(batches)])["probabilities"].numpy()
                    counts[i] += size

            started, cpu = time.monotonic(), _self_cpu_seconds()
            threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            count = sum(counts)
            rate, cpu = count / (time.monotonic() - started), _self_cpu_seconds() - cpu
            if rate > best.rate:
                best = Limit(rate, size, callers, 1000 * cpu / count, 0.0)
    singles = [tf.constant([p]) for p in photos]
    times = []
    for i in range(max(200, int(seconds * 100))):
        started = time.monotonic()
        signature(image_bytes=singles[i % len(singles)])["probabilities"].numpy()
        times.append(time.monotonic() - started)
    best.single_ms = float(np.percentile(times, 50) * 1000)
    return best


# --- servers --------------------------------------------------------------------------------------------------

def wait_for_every_worker(requests: Requests, connections: int = 16, timeout: float = 180.0) -> None:
    """/readyz answers from one worker only; with --workers > 1 the others may still be loading their model,
    so wait until predictions on many fresh connections (spread over the workers by the kernel) all succeed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sends = [_http_client(requests) for _ in range(connections)]
        ok = all(send(requests.bodies[0]) for send, _ in sends)
        for _, close in sends:
            close()
        if ok:
            return
        time.sleep(0.5)
    raise TimeoutError("not every worker became ready")


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
    base = os.path.join(ROOT, "exported_models", MODEL)
    versions = sorted(int(v) for v in os.listdir(base) if v.isdigit()) if os.path.isdir(base) else []
    if versions:
        return base
    from training.export import export_saved_model
    from training.models import build_model

    base = os.path.join(tempfile.mkdtemp(prefix="petal-bench-"), MODEL)
    export_saved_model(build_model("compact", 5, image_size), base,
                       ["daisy", "dandelion", "roses", "sunflowers", "tulips"], image_size, version=1)
    return base


def photo_sets(sizes: list[tuple[int, int]]) -> dict[str, list[bytes]]:
    """Synthetic flower photos, one of each class in turn, JPEG-encoded at the recipe's quality range."""
    from training.synth import CLASSES, render

    return {f"{w}x{h}": [render(CLASSES[i % len(CLASSES)], seed=i, size=(w, h)) for i in range(PHOTOS)]
            for w, h in sizes}


# --- report ---------------------------------------------------------------------------------------------------

COLUMNS = ("rest", "grpc", "v2", "baseline")
TITLES = {"rest": "Petal REST", "grpc": "Petal gRPC", "v2": "Petal V2 binary", "baseline": "naive Flask"}


def cell(r: dict) -> str:
    return f"{r['rps']:.0f} ({r['p50']:.1f} / {r['p95']:.1f} / {r['p99']:.1f})"


def report(name: str, photos: list[bytes], limit: Limit, results: dict[str, dict[int, dict]],
           ceilings: dict[str, dict[int, dict]], levels: list[int]) -> None:
    mean_kb = sum(map(len, photos)) / len(photos) / 1024
    print(f"\n### {name} photos ({mean_kb:.0f} KB JPEG on average): in-process limit {limit.rate:.0f} images/s "
          f"(batch {limit.batch}, {limit.callers} calling, {limit.cpu_ms:.2f} ms CPU per image), single image "
          f"{limit.single_ms:.2f} ms\n")
    print("| concurrency | " + " | ".join(f"{TITLES[c]} img/s (p50 / p95 / p99 ms)" for c in COLUMNS)
          + " | REST / limit | gRPC / limit | V2 / limit | REST / baseline | gRPC / REST |")
    print("|---" * (len(COLUMNS) + 6) + "|")
    for c in levels:
        r = {col: results[col][c] for col in COLUMNS}
        print(f"| {c} | " + " | ".join(cell(r[col]) for col in COLUMNS)
              + "".join(f" | {r[col]['rps'] / limit.rate:.2f}" for col in ("rest", "grpc", "v2"))
              + f" | {r['rest']['rps'] / max(r['baseline']['rps'], 1e-9):.2f}"
              f" | {r['grpc']['rps'] / max(r['rest']['rps'], 1e-9):.2f} |")
    first = levels[0]
    print(f"\np50 overhead at concurrency {first} over the in-process {limit.single_ms:.2f} ms: "
          + ", ".join(f"{TITLES[col]} {results[col][first]['p50'] - limit.single_ms:+.2f} ms" for col in COLUMNS))
    for c in ceilings["http"]:
        print(f"at concurrency {c}, CPU per image (server + load generator): "
              + ", ".join(f"{TITLES[col]} {r['server_cpu_ms']:.2f} + {r['loadgen_cpu_ms']:.2f} ms"
                          for col, r in ((col, results[col][c]) for col in COLUMNS))
              + f"; load generator ceiling {ceilings['http'][c]['rps']:.0f} req/s on /healthz, "
              f"{ceilings['grpc'][c]['rps']:.0f} on gRPC health Check")
        _bound(limit, results, ceilings, c)


def _bound(limit: Limit, results: dict[str, dict[int, dict]], ceilings: dict[str, dict[int, dict]], c: int) -> None:
    """What the cores allow when every image pays the model's best-batch CPU plus the cheapest possible request
    (the server's and the load generator's CPU for a /healthz or health Check on the same machine)."""
    cores = os.cpu_count() or 1
    for protocol, cols in (("http", ("rest", "v2")), ("grpc", ("grpc",))):
        trivial = ceilings[protocol][c]
        per_image = limit.cpu_ms + trivial["server_cpu_ms"] + trivial["loadgen_cpu_ms"]
        bound = 1000 * cores / per_image
        print(f"  {'/'.join(TITLES[col] for col in cols)}: {cores} cores / ({limit.cpu_ms:.2f} model + "
              f"{trivial['server_cpu_ms']:.2f} server + {trivial['loadgen_cpu_ms']:.2f} load generator ms for a "
              f"trivial request) = at most {bound:.0f} images/s = {bound / limit.rate:.2f} x the limit")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_loadgen":
        return loadgen_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_base_path", default=None, help="default: exported_models/flowers")
    parser.add_argument("--image_size", type=int, default=64, help="model input size if no model is shipped")
    parser.add_argument("--photo_sizes", default="480x360,64x64", help="WxH of the photo sets, first is primary")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds sent before measuring")
    parser.add_argument("--limit_seconds", type=float, default=1.0, help="seconds per in-process batch size")
    parser.add_argument("--petal_args", default="", help="extra `petal serve` flags, space-separated")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from server_harness import free_port, run_server

    base = args.model_base_path or default_model(args.image_size)
    version = max(int(v) for v in os.listdir(base) if v.isdigit())
    model_dir = os.path.join(base, str(version))
    levels = [int(c) for c in args.concurrency.split(",")]
    sets = photo_sets([tuple(int(x) for x in s.split("x")) for s in args.photo_sizes.split(",")])
    load = os.getloadavg()
    print(f"model {model_dir}; {os.cpu_count()} cores; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{args.duration:g}s per run after {args.warmup:g}s warmup", flush=True)

    limits = {name: in_process_limit(model_dir, photos, args.limit_seconds) for name, photos in sets.items()}
    results: dict[str, dict[str, dict[int, dict]]] = {name: {} for name in sets}
    run = lambda requests: run_loadgen(requests, levels, args.duration, args.warmup)  # noqa: E731
    with run_server(f"--model_base_path={base}", *args.petal_args.split()) as server:
        pid = server.proc.pid
        rest_port = int(server.rest_url.rsplit(":", 1)[1])
        grpc_port = int(server.grpc_target.rsplit(":", 1)[1])
        wait_for_every_worker(rest_requests(rest_port, pid, next(iter(sets.values()))))
        busy = [c for c in levels if c >= 16] or levels[-1:]
        ceilings = {protocol: run_loadgen(health_requests(protocol, port, pid), busy, args.duration, args.warmup)
                    for protocol, port in (("http", rest_port), ("grpc", grpc_port))}
        for name, photos in sets.items():
            results[name]["rest"] = run(rest_requests(rest_port, pid, photos))
            results[name]["grpc"] = run(grpc_requests(grpc_port, pid, photos))
            results[name]["v2"] = run(v2_binary_requests(rest_port, pid, photos))
            print(f"{name}: Petal done", flush=True)
    baseline_port = free_port()
    proc = start_baseline(model_dir, baseline_port)
    try:
        for name, photos in sets.items():
            results[name]["baseline"] = run(rest_requests(baseline_port, proc.pid, photos))
    finally:
        proc.terminate()
        proc.wait(30)

    for name, photos in sets.items():
        report(name, photos, limits[name], results[name], ceilings, levels)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    errors = sum(r["errors"] for per in results.values() for col in per.values() for r in col.values())
    print(f"errors: {errors}")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
