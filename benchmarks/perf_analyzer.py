"""perf_analyzer, Triton's load generator, as a second one beside Locust: it drives a `petal serve` over KServe V2
HTTP, V2 gRPC and TF Serving's gRPC API (--service-kind=tfserving), and over the V2 kinds reads Petal's statistics
extension to split the server's time into queue and compute, as it does for Triton.

    .venv/bin/python benchmarks/perf_analyzer.py [--concurrency 1,16] [--requests 300] [--photo_size 64x64]

`make install` fetches the binary (load_tests/perf_analyzer.py says how, and what it needs); --perf_analyzer takes
a binary of your own instead. Two models: the image model (the shipped one unless --model_base_path names
another), one JPEG per request, over the V2 kinds; and TF Serving's own TF1 half_plus_two
(exported_models/tf_serving_models.py), whose x:0 is fed by name, over all three kinds (load_tests/perf_analyzer.py
says why the image model is not run over tfserving).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from exported_models import DEFAULT_MODEL_BASE_PATH
    from exported_models.tf_serving_models import half_plus_two
    from load_tests import launcher, perf_analyzer
    from training.synth import CLASSES, render

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_base_path", default=DEFAULT_MODEL_BASE_PATH, help="the image model")
    parser.add_argument("--photo_size", default="64x64")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=300, help="requests per measurement window")
    parser.add_argument("--perf_analyzer", default=None, help="a perf_analyzer binary (default: PATH, or fetched)")
    parser.add_argument("--petal_args", default="", help="extra `petal serve` flags, space-separated")
    args = parser.parse_args()
    tool = perf_analyzer.find(args.perf_analyzer)
    if tool.missing_libraries():
        sys.exit(f"perf_analyzer needs {tool.missing_libraries()}: apt-get install libb64-0d")
    width, height = map(int, args.photo_size.split("x"))
    photos = [render(CLASSES[i % len(CLASSES)], seed=i, size=(width, height)) for i in range(8)]
    image_model, float_model = perf_analyzer.IMAGE_MODEL, perf_analyzer.FLOAT_MODEL
    with tempfile.TemporaryDirectory() as folder:
        half_plus_two(os.path.join(folder, float_model, "00000123"))
        config = os.path.join(folder, "models.config")
        with open(config, "w") as f:
            f.write(f'model_config_list {{ config {{ name: "{image_model}" base_path: '
                    f'"{args.model_base_path}" model_platform: "tensorflow" }} config {{ '
                    f'name: "{float_model}" base_path: "{os.path.join(folder, float_model)}" '
                    'model_platform: "tensorflow" } }')
        models = {image_model: perf_analyzer.image_data(photos, folder), float_model: None}
        with launcher.running([f"--model_config_file={config}", *args.petal_args.split()], cwd=ROOT) as server:
            print(f"perf_analyzer against Petal, {args.requests} requests a window, {width}x{height} JPEGs; "
                  "rate in requests/s, latencies and server times in ms")
            print(f"{'model':8} {'kind':10} {'conc':>4} {'rate':>7} {'p50':>7} {'p95':>7} {'p99':>7} "
                  f"{'queue':>7} {'compute':>8}")
            for kind, model in perf_analyzer.runs(models):
                for concurrency in map(int, args.concurrency.split(",")):
                    r = perf_analyzer.measure(tool, perf_analyzer.arguments(
                        kind, model, server.rest_port, server.grpc_port, concurrency, args.requests, models[model]))
                    print(f"{model:8} {kind:10} {concurrency:>4} {r['rps']:>7.0f} {r['p50']:>7.2f} "
                          f"{r['p95']:>7.2f} {r['p99']:>7.2f} {r['queue']:>7.2f} {r['compute']:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
