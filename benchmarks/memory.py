"""A server's memory under a pixel flood, over each protocol: large flat-colour JPEGs, cheap on the wire and huge
once decoded.

    .venv/bin/python benchmarks/memory.py [--clients 8] [--images 32] [--side 6000] [--progressive] \
        [--protocols rest,v2,multipart,grpc] [--petal_args "--memory_budget_bytes=268435456"] \
        [--pod_limit 2147483648 [--checkout DIR]]

Each of `--clients` clients sends one request of `--images` JPEGs of side x side pixels at once (a 6000 x 6000 flat
colour is 0.56 MB on the wire and 108 MB decoded): a REST `:predict` of base64 JSON (about 23 MB for 32), a V2
`infer` with the images as binary data, a gRPC Predict, or, since `:classify_image` takes one image a request,
clients x images multipart `:classify_image` requests at once. The figures are the server's whole process group
(the gunicorn master and its worker): resident memory idle, its peak during the flood (the sum of each process's
kernel high-water mark, VmHWM, reset before the flood; writing to clear_refs needs the processes' owner) and 5 s
after; and how the requests were answered (HTTP statuses; gRPC codes as the HTTP status they map to). Every
protocol gets a fresh server, started with `--petal_args` (default: none, the derived budget), on the shipped model
unless they name one. The flood and the memory readings are load_tests/pixel_flood.py's.

With `--pod_limit`, each server runs as a fresh pod of that many bytes does (load_tests/fresh_pod.py: a memory cgroup
it sees as its own, a cold page cache; needs root), and the figures are the cgroup's, as Kubernetes sees them:
its usage (page cache included), working set and file pages idle, the peaks of the working set and the usage
during the flood, and how often the usage reached the limit (failed charges) or a process was OOM-killed.
`--checkout` runs the server of another checkout of this repository (an older commit's, say) under this script.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MB = 1024 * 1024
PROTOCOLS = ("rest", "v2", "multipart", "grpc")
TIMEOUT_S = 600


def process_group(master: int) -> list[int]:
    """The server's processes: the master and its workers."""
    children = subprocess.run(["pgrep", "-P", str(master)], capture_output=True, text=True).stdout.split()
    return [master, *map(int, children)]


def measure(protocol: str, extra: list[str], image: bytes, images: int, clients: int) -> dict:
    """One flood against a fresh server; sizes in bytes."""
    from load_tests import launcher
    from load_tests.pixel_flood import flood, flood_requests, reset_peak, status_kb

    with launcher.running(extra, cwd=ROOT) as server:
        pids = process_group(server.proc.pid)
        for pid in pids:
            reset_peak(pid)
        idle = sum(status_kb(pid, "VmRSS") for pid in pids) * 1024
        started = time.monotonic()
        statuses = flood(flood_requests(protocol, server, image, images, clients, TIMEOUT_S))
        elapsed = time.monotonic() - started
        peak = sum(status_kb(pid, "VmHWM") for pid in pids) * 1024
        time.sleep(5)
        after = sum(status_kb(pid, "VmRSS") for pid in pids) * 1024
    return {"protocol": protocol, "idle": idle, "peak": peak, "after": after, "seconds": elapsed,
            "statuses": statuses}


def measure_pod(protocol: str, extra: list[str], image: bytes, images: int, clients: int, limit: int,
                checkout: str) -> dict:
    """One flood against a server started as a fresh pod of `limit` bytes; the cgroup's figures, in bytes."""
    from load_tests import launcher
    from load_tests.fresh_pod import fresh_pod
    from load_tests.pixel_flood import flood, flood_requests

    with fresh_pod(limit) as pod, launcher.running(extra, env=pod.env, wrapper=pod.wrapper, cwd=checkout) as server:
        idle = pod.read()
        started = time.monotonic()
        with pod.sampled() as peaks:
            statuses = flood(flood_requests(protocol, server, image, images, clients, TIMEOUT_S))
        elapsed = time.monotonic() - started
        alive = server.proc.poll() is None
    assert peaks.last is not None
    return {"protocol": protocol, "idle": idle, "peaks": peaks, "seconds": elapsed, "statuses": statuses,
            "alive": alive}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--images", type=int, default=32, help="images per request")
    parser.add_argument("--side", type=int, default=6000, help="pixels per side (under --max_image_pixels)")
    parser.add_argument("--progressive", action="store_true", help="progressive JPEGs, whose decoders hold the "
                        "whole image's DCT coefficients at any scale")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), help="comma-separated: " + ", ".join(PROTOCOLS))
    parser.add_argument("--petal_args", default="", help="flags for every server")
    parser.add_argument("--pod_limit", type=int, default=0, help="run each server as a fresh pod of this many bytes")
    parser.add_argument("--checkout", default=ROOT, help="the checkout whose server runs (with --pod_limit)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from load_tests.pixel_flood import flat_jpeg

    image = flat_jpeg(args.side, args.progressive)
    print(f"{args.clients} clients x {args.images} x {args.side}x{args.side} JPEGs ({len(image) / MB:.2f} MB each "
          f"on the wire, {args.side * args.side * 3 / MB:.0f} MB decoded); petal serve {args.petal_args}\n")
    if args.pod_limit:
        from load_tests.fresh_pod import unavailable

        if unavailable():
            print(f"--pod_limit: {unavailable()}", file=sys.stderr)
            return 2
        return print_pods(args, image)
    print("| protocol | idle RSS MB | peak RSS MB | peak - idle | RSS 5 s after MB | seconds | statuses |")
    print("|---|---|---|---|---|---|---|")
    for protocol in args.protocols.split(","):
        r = measure(protocol, args.petal_args.split(), image, args.images, args.clients)
        print(f"| {protocol} | {r['idle'] / MB:.0f} | {r['peak'] / MB:.0f} | {(r['peak'] - r['idle']) / MB:+.0f} | "
              f"{r['after'] / MB:.0f} | {r['seconds']:.1f} | {json.dumps(r['statuses'], sort_keys=True)} |",
              flush=True)
    return 0


def print_pods(args: argparse.Namespace, image: bytes) -> int:
    limit = args.pod_limit
    print(f"in a fresh pod of {limit / MB:.0f} MiB, server from {args.checkout}\n")
    print("| protocol | idle usage MiB | idle working set | idle file | peak working set | peak usage | "
          "failed charges | OOM kills | seconds | statuses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for protocol in args.protocols.split(","):
        r = measure_pod(protocol, args.petal_args.split(), image, args.images, args.clients, limit, args.checkout)
        idle, peaks = r["idle"], r["peaks"]
        statuses = json.dumps(r["statuses"], sort_keys=True) + ("" if r["alive"] else ", server died")
        print(f"| {protocol} | {idle.usage / MB:.0f} | {idle.working_set / MB:.0f} | {idle.file / MB:.0f} | "
              f"{peaks.working_set / MB:.0f} ({peaks.working_set / limit:.0%}) | "
              f"{peaks.usage / MB:.0f} ({peaks.usage / limit:.0%}) | {peaks.last.failed_charges} | "
              f"{peaks.last.oom_kills} | {r['seconds']:.1f} | {statuses} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
