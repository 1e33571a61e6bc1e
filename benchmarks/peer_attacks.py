"""The gRPC port under the HTTP/2 attacks of 2023–2024, the REST port under one peer's 1,000 connections, and what
a normal client gets meanwhile: the tables of docs/security.md.

    .venv/bin/python benchmarks/peer_attacks.py [--seconds 12] [--attacks rapid_reset,...] [--rest_connections 1000] \
        [--checkout DIR ...] [--petal_args "..."]

For each checkout (default: this one; give `--checkout /path/to/older/main --checkout .` for before and after,
each server run under this script's interpreter) and each attack of load_tests/peer_attacks.py, a fresh
`petal serve` (the shipped model, default flags plus `--petal_args`) is attacked for `--seconds` from 127.0.0.2
while a normal client on 127.0.0.1 calls Predict with TF Serving's stubs every 50 ms with a 2 s deadline; then the
same client calls for 3 s more. The growth is the server's whole process group: the sum of each process's peak
resident memory during the attack (VmHWM, reset before it) less its resident memory before. Then, for each front
end (gevent, gthread), `--rest_connections` connections from 127.0.0.2 each send a request head a byte every 0.5 s
(a slow-loris, reconnecting as the server closes them; --max_connections is 1,000 by default) while a normal REST
client on 127.0.0.1 posts a predict every 50 ms with a 2 s timeout, measured from 2 s into the attack.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MB = 1024 * 1024
AFTER_S = 3.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="how long each attack lasts")
    parser.add_argument("--attacks", default="", help="comma-separated names (default: all)")
    parser.add_argument("--checkout", action="append", help="a checkout whose server runs (repeatable)")
    parser.add_argument("--petal_args", default="", help="flags for every server")
    parser.add_argument("--rest_connections", type=int, default=1000, help="the REST peer's connections (0: none)")
    args = parser.parse_args()
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
    from memory import process_group  # benchmarks/memory.py
    from tensorflow_serving.apis import predict_pb2

    from load_tests import launcher
    from load_tests.peer_attacks import ATTACKS, Attack, Normal, NormalRest, slow_heads
    from load_tests.pixel_flood import flat_jpeg, reset_peak, status_kb

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    tensor = request.inputs["image_bytes"]
    tensor.dtype = 7  # DT_STRING
    tensor.tensor_shape.dim.add().size = 1
    tensor.string_val.append(flat_jpeg(224))
    names = args.attacks.split(",") if args.attacks else list(ATTACKS)
    print(f"each attack {args.seconds:g} s from 127.0.0.2, a normal Predict every 50 ms (2 s deadline) from "
          f"127.0.0.1; petal serve {args.petal_args}\n")
    for checkout in args.checkout or [ROOT]:
        print(f"checkout {os.path.abspath(checkout)}\n")
        print("| attack | connections | the normal client during it | after it | growth of the server MB | alive |")
        print("|---|---|---|---|---|---|")
        for name in names:
            attack, connections = ATTACKS[name]
            with launcher.running(args.petal_args.split(), cwd=checkout) as server:
                normal = Normal(server.grpc_target, request)
                normal.calls(1.0)  # warm
                pids = process_group(server.proc.pid)
                idle = sum(status_kb(pid, "VmRSS") for pid in pids)
                for pid in pids:
                    reset_peak(pid)
                running = Attack(server.grpc_target, attack, connections)
                during = normal.calls(args.seconds)
                running.end()
                peak = sum(status_kb(pid, "VmHWM") for pid in pids)
                time.sleep(0.5)
                after = normal.calls(AFTER_S)
                normal.close()
                alive = server.proc.poll() is None
            print(f"| {name} | {connections} | {during.summary()} | {after.summary()} | "
                  f"{(peak - idle) / 1024:+.0f} | {alive} |", flush=True)
        print()
        if not args.rest_connections:
            continue
        print(f"| REST front end | the normal client during {args.rest_connections} slow connections | after |")
        print("|---|---|---|")
        body = json.dumps({"instances": [{"b64": base64.b64encode(request.inputs["image_bytes"].string_val[0])
                                          .decode()}]}).encode()
        for front_end in ("gevent", "gthread"):
            with launcher.running([*args.petal_args.split(), f"--worker_class={front_end}"], cwd=checkout) as server:
                rest = NormalRest(server.rest_url + "/v1/models/flowers:predict", body)
                rest.calls(1.0)  # warm
                running = Attack(server.rest_url.split("//", 1)[1], slow_heads, args.rest_connections)
                time.sleep(2.0)
                during = rest.calls(args.seconds)
                running.end()
                time.sleep(0.5)
                after = rest.calls(AFTER_S)
                rest.close()
            print(f"| {front_end} | {during.summary()} | {after.summary()} |", flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
