"""perf_analyzer, Triton's load generator, as a second one beside Locust: it drives a `petal serve` over KServe V2
HTTP, V2 gRPC and TF Serving's gRPC API (--service-kind=tfserving), and over the V2 kinds reads Petal's statistics
extension to split the server's time into queue and compute, as it does for Triton.

    .venv/bin/python benchmarks/perf_analyzer.py [--concurrency 1,16] [--requests 300] [--photo_size 64x64]

perf_analyzer is a C++ binary shipped in the tritonclient 2.41.0 wheel. It is not pip-installed, since that
wheel's Python package would replace the newer tritonclient the server depends on: `fetch` pip-downloads the
wheel and nvidia-cuda-runtime-cu12 (its libcudart.so.12, which perf_analyzer links even without a GPU) and
unpacks the binary and the library into the virtual environment's `perf_analyzer/` folder. `make install` does
this, so neither the benchmark nor the tests download anything when they run. It also needs Debian's libb64-0d
(`apt-get install libb64-0d`; .ci/run installs it). --perf_analyzer takes a binary of your own instead.

Two models: the image model, one JPEG per request (perf_analyzer's --input-data "b64" holds a BYTES tensor as
Triton serializes it: each element's 4-byte little-endian length, then its bytes), over the V2 kinds; and TF
Serving's own TF1 half_plus_two (tests/tf_serving_models.py), whose x:0 is fed by name, over all three kinds:
--service-kind=tfserving sends it x of shape [1] (--shape x:1), as TF Serving's test client does. The image model is
not run over tfserving: perf_analyzer 2.41's TF Serving client steps over each string's bytes but not its length
prefix, so it cannot send one string (Petal answers what arrives: INVALID_ARGUMENT).
"""
from __future__ import annotations

import argparse
import base64
import csv
import glob
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
WHEELS = ("tritonclient==2.41.0", "nvidia-cuda-runtime-cu12==12.*")
CACHE = os.path.join(sys.prefix, "perf_analyzer")  # inside the virtual environment, made by `make install`
IMAGE_MODEL, FLOAT_MODEL = "flowers", "half"
KINDS = ("v2-http", "v2-grpc", "tfserving")
# perf_analyzer's CSV columns (microseconds) and the names this report gives them.
COLUMNS = {"Inferences/Second": "rps", "p50 latency": "p50", "p95 latency": "p95", "p99 latency": "p99",
           "Server Queue": "queue", "Server Compute Infer": "compute"}


@dataclass(frozen=True)
class Tool:
    binary: str
    library_dir: str  # where libcudart.so.12 is; "" when the system has it

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [self.library_dir, os.environ.get("LD_LIBRARY_PATH", "")]))
        return {**os.environ, "LD_LIBRARY_PATH": path}

    def missing_libraries(self) -> list[str]:
        """What the dynamic linker cannot find (libb64.so.0d without Debian's libb64-0d, say)."""
        out = subprocess.run(["ldd", self.binary], env=self.env(), capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if "not found" in line]


def fetch(cache: str = CACHE) -> Tool:
    """perf_analyzer and libcudart.so.12 unpacked from their PyPI wheels into `cache` (downloaded once)."""
    binary = os.path.join(cache, "bin", "perf_analyzer")
    library_dir = os.path.join(cache, "lib")
    if not os.path.exists(binary):
        wheels = os.path.join(cache, "wheels")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--dest", wheels, *WHEELS], check=True)
        os.makedirs(library_dir, exist_ok=True)
        for wheel in glob.glob(os.path.join(wheels, "*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.endswith("/bin/perf_analyzer"):
                        unpack(archive, name, binary)
                    elif name.endswith("/libcudart.so.12"):
                        unpack(archive, name, os.path.join(library_dir, "libcudart.so.12"))
        os.chmod(binary, 0o755)
    return Tool(binary, library_dir)


def unpack(archive: zipfile.ZipFile, name: str, dest: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with archive.open(name) as source, open(dest + ".part", "wb") as target:
        shutil.copyfileobj(source, target)
    os.replace(dest + ".part", dest)


def find(binary: str | None = None) -> Tool:
    """--perf_analyzer's binary, else one on PATH, else the one `make install` fetched."""
    binary = binary or shutil.which("perf_analyzer") or os.path.join(CACHE, "bin", "perf_analyzer")
    if not os.path.exists(binary):
        raise FileNotFoundError(f"no perf_analyzer at {binary}: run `make install` (or pass --perf_analyzer)")
    return Tool(binary, os.path.join(CACHE, "lib"))


def image_data(photos: list[bytes], folder: str) -> str:
    """An --input-data file of one request per photo."""
    path = os.path.join(folder, "images.json")
    entries = [{"image_bytes": {"b64": base64.b64encode(struct.pack("<I", len(p)) + p).decode()}} for p in photos]
    with open(path, "w") as f:
        json.dump({"data": entries}, f)
    return path


def arguments(kind: str, model: str, rest_port: int, grpc_port: int, concurrency: int, requests: int,
              data: str | None) -> list[str]:
    """One measurement: `requests` per window (count_windows), at most three windows, every result reported
    (a shared machine is never stable to perf_analyzer's default 10%)."""
    if kind == "v2-http":
        target = ["-i", "http", "-u", f"127.0.0.1:{rest_port}"]
    else:
        target = ["-i", "grpc", "-u", f"127.0.0.1:{grpc_port}"]
    if kind == "tfserving":
        target += ["--service-kind=tfserving", "--shape", "x:1"]
    load = ["--concurrency-range", str(concurrency), "--measurement-mode", "count_windows",
            "--measurement-request-count", str(requests), "--max-trials", "3", "--stability-percentage", "1000"]
    return ["-m", model, *target, *load, *(["--input-data", data] if data else [])]


def measure(tool: Tool, args: list[str], timeout: float = 300.0) -> dict[str, float]:
    """perf_analyzer's figures for one run, in milliseconds (and requests/s): its CSV report parsed."""
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "report.csv")
        done = subprocess.run([tool.binary, *args, "-f", report], env=tool.env(), capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer {' '.join(args)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        with open(report) as f:
            (row,) = list(csv.DictReader(io.StringIO(f.read())))
    # TF Serving has no statistics extension, so that kind's report has no server columns: NaN.
    return {name: float(row.get(column, "nan")) / (1 if name == "rps" else 1000) for column, name in COLUMNS.items()}


def runs(models: Iterable[str]) -> list[tuple[str, str]]:
    """(kind, model) pairs: the float model over every kind, the image model over the V2 kinds only."""
    return [(kind, model) for model in models for kind in KINDS if not (model == IMAGE_MODEL and kind == "tfserving")]


def main() -> int:
    from exported_models.model_format import DEFAULT_MODEL_BASE_PATH, exported_versions
    from server_harness import tiny_model_base
    from serving import launcher
    from tf_serving_models import half_plus_two
    from training.synth import CLASSES, render

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_base_path", default=None, help="the image model; default: the shipped one, "
                        "else the tests' tiny model")
    parser.add_argument("--photo_size", default="64x64")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=300, help="requests per measurement window")
    parser.add_argument("--perf_analyzer", default=None, help="a perf_analyzer binary (default: PATH, or fetched)")
    parser.add_argument("--petal_args", default="", help="extra `petal serve` flags, space-separated")
    args = parser.parse_args()
    tool = find(args.perf_analyzer)
    if tool.missing_libraries():
        sys.exit(f"perf_analyzer needs {tool.missing_libraries()}: apt-get install libb64-0d")
    width, height = map(int, args.photo_size.split("x"))
    photos = [render(CLASSES[i % len(CLASSES)], seed=i, size=(width, height)) for i in range(8)]
    image_model = args.model_base_path or (DEFAULT_MODEL_BASE_PATH if exported_versions(DEFAULT_MODEL_BASE_PATH)
                                            else tiny_model_base())
    with tempfile.TemporaryDirectory() as folder:
        half_plus_two(os.path.join(folder, FLOAT_MODEL, "00000123"))
        config = os.path.join(folder, "models.config")
        with open(config, "w") as f:
            f.write(f'model_config_list {{ config {{ name: "{IMAGE_MODEL}" base_path: '
                    f'"{image_model}" model_platform: "tensorflow" }} config {{ '
                    f'name: "{FLOAT_MODEL}" base_path: "{os.path.join(folder, FLOAT_MODEL)}" '
                    'model_platform: "tensorflow" } }')
        models = {IMAGE_MODEL: image_data(photos, folder), FLOAT_MODEL: None}
        with launcher.running([f"--model_config_file={config}", *args.petal_args.split()], cwd=ROOT) as server:
            print(f"perf_analyzer against Petal, {args.requests} requests a window, {width}x{height} JPEGs; "
                  "rate in requests/s, latencies and server times in ms")
            print(f"{'model':8} {'kind':10} {'conc':>4} {'rate':>7} {'p50':>7} {'p95':>7} {'p99':>7} "
                  f"{'queue':>7} {'compute':>8}")
            for kind, model in runs(models):
                for concurrency in map(int, args.concurrency.split(",")):
                    r = measure(tool, arguments(kind, model, server.rest_port, server.grpc_port, concurrency,
                                                args.requests, models[model]))
                    print(f"{model:8} {kind:10} {concurrency:>4} {r['rps']:>7.0f} {r['p50']:>7.2f} "
                          f"{r['p95']:>7.2f} {r['p99']:>7.2f} {r['queue']:>7.2f} {r['compute']:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
