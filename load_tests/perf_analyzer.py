"""perf_analyzer, Triton's load generator, as a second one beside Locust: where it is, its command line for each
service kind Petal answers, and its report read back. The benchmark (benchmarks/perf_analyzer.py) and its test
(tests/e2e/test_perf_analyzer.py) both drive it through this module.

perf_analyzer is a C++ binary shipped in the tritonclient 2.41.0 wheel. It is not pip-installed, since that wheel's
Python package would replace the newer tritonclient the server depends on: `python -m load_tests.perf_analyzer
[--dest DIR]` pip-downloads the wheel and nvidia-cuda-runtime-cu12 (its libcudart.so.12, which perf_analyzer links
even without a GPU) and unpacks the binary and the library into DIR, by default the virtual environment's
`perf_analyzer/` folder. `make install` runs it, so neither the benchmark nor the tests download anything when they
run. The binary also needs Debian's libb64-0d (`apt-get install libb64-0d`; .ci/run installs it).

Two models: the image model, one JPEG per request, over the V2 kinds; and TF Serving's TF1 half_plus_two, whose
x:0 is fed by name, over all three: --service-kind=tfserving sends it x of shape [1] (--shape x:1), as TF Serving's
test client does. The image model is not run over tfserving: perf_analyzer 2.41's TF Serving client steps over
each string's bytes but not its length prefix, so it cannot send one string (Petal answers what arrives:
INVALID_ARGUMENT).
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
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass

from serving.protocols.codec.v2_bytes import frame

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
                        _unpack(archive, name, binary)
                    elif name.endswith("/libcudart.so.12"):
                        _unpack(archive, name, os.path.join(library_dir, "libcudart.so.12"))
        os.chmod(binary, 0o755)
    return Tool(binary, library_dir)


def _unpack(archive: zipfile.ZipFile, name: str, dest: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with archive.open(name) as source, open(dest + ".part", "wb") as target:
        shutil.copyfileobj(source, target)
    os.replace(dest + ".part", dest)


def find(binary: str | None = None) -> Tool:
    """The given binary, else one on PATH, else the one `make install` fetched."""
    binary = binary or shutil.which("perf_analyzer") or os.path.join(CACHE, "bin", "perf_analyzer")
    if not os.path.exists(binary):
        raise FileNotFoundError(f"no perf_analyzer at {binary}: run `make install` (or pass --perf_analyzer)")
    return Tool(binary, os.path.join(CACHE, "lib"))


def image_data(photos: list[bytes], folder: str) -> str:
    """An --input-data file of one request per photo: "b64" holds a BYTES tensor as Triton serializes it, each
    element framed with its length (serving/protocols/codec/v2_bytes.py)."""
    path = os.path.join(folder, "images.json")
    entries = [{"image_bytes": {"b64": base64.b64encode(frame([p])).decode()}} for p in photos]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.perf_analyzer",
                                     description="Fetch perf_analyzer from its PyPI wheels (once).")
    parser.add_argument("--dest", default=CACHE, help=f"where to unpack it (default: {CACHE})")
    tool = fetch(parser.parse_args(argv).dest)
    print(f"perf_analyzer: {tool.binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
