"""A worker's memory under a pixel flood: large flat-colour JPEGs, cheap on the wire and huge once decoded.

    .venv/bin/python benchmarks/memory.py [--clients 4,8] [--images 32] [--side 6000] [--petal_args "..."]

Each client sends one `:predict` of `--images` JPEGs of side x side pixels (a 6000 x 6000 flat colour is 0.56 MB
on the wire and 108 MB decoded). The worker's resident memory is sampled while the flood runs (the peak is the
kernel's high-water mark, VmHWM, reset before the flood; writing to clear_refs needs the process's owner) and again 5 s after it, against its idle size before: the figures to hold against
`--max_inflight_pixels` and the pod's memory limit. Runs side by side: the same flood against a server with the
default pixel budget and one with the budget turned off (`--max_inflight_pixels=-1`), unless --petal_args says
otherwise.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
MB = 1024 * 1024


def flood(url: str, body: bytes, clients: int) -> dict[int, int]:
    """Every client sends its request at once; the status codes, counted."""
    statuses: dict[int, int] = {}

    def send() -> None:
        try:
            code = requests.post(url + "/v1/models/flowers:predict", data=body, timeout=600,
                                 headers={"Content-Type": "application/json"}).status_code
        except requests.RequestException:
            code = 0
        statuses[code] = statuses.get(code, 0) + 1
    threads = [threading.Thread(target=send) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def measure(label: str, extra: list[str], body: bytes, levels: list[int]) -> None:
    from server_harness import reset_peak, run_server, status_kb, tiny_model_base, worker_pid

    for clients in levels:
        with run_server(f"--model_base_path={tiny_model_base()}", "--port=0", *extra) as server:
            pid = worker_pid(server.proc.pid)
            reset_peak(pid)
            idle = status_kb(pid, "VmRSS")
            started = time.monotonic()
            statuses = flood(server.rest_url, body, clients)
            elapsed = time.monotonic() - started
            peak = status_kb(pid, "VmHWM")
            time.sleep(5)
            after = status_kb(pid, "VmRSS")
        print(f"| {label} | {clients} | {idle / 1024:.0f} | {peak / 1024:.0f} | {(peak - idle) / 1024:+.0f} | "
              f"{after / 1024:.0f} | {elapsed:.1f} | {json.dumps(statuses, sort_keys=True)} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="4,8", help="concurrent clients, one flood each")
    parser.add_argument("--images", type=int, default=32, help="images per request")
    parser.add_argument("--side", type=int, default=6000, help="pixels per side (under --max_image_pixels)")
    parser.add_argument("--petal_args", default=None, help="compare only this configuration")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from server_harness import flat_jpeg

    image = flat_jpeg(args.side)
    body = json.dumps({"instances": [{"b64": base64.b64encode(image).decode()}] * args.images}).encode()
    print(f"{args.images} x {args.side}x{args.side} JPEGs per request ({len(image) / MB:.2f} MB each on the wire, "
          f"{args.side * args.side * 3 / MB:.0f} MB decoded; body {len(body) / MB:.1f} MB)\n")
    print("| server | clients | idle RSS MB | peak RSS MB | peak - idle | RSS 5 s after MB | seconds | statuses |")
    print("|---|---|---|---|---|---|---|---|")
    levels = [int(c) for c in args.clients.split(",")]
    configs = {"given flags": args.petal_args.split()} if args.petal_args is not None else {
        "default budget": [], "no budget": ["--max_inflight_pixels=-1"]}
    for label, extra in configs.items():
        measure(label, extra, body, levels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
