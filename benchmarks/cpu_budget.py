"""Where a served image's CPU goes, by thread, beside what the model alone costs at each batch size.

    .venv/bin/python benchmarks/cpu_budget.py [--concurrency 1,16,64] [--protocols rest,grpc,v2] [--duration 6]

1. The model alone: the shipped flowers signature run in this process as a worker runs it (serving/core/runtimes.py's
   Session callable, on the TensorFlow runtime that serving/process/tensorflow_runtime.py sets up from the default
   flags: one intra-op thread per batch thread, no spin-waits), one caller, on batches of 1 to 64 of the 480x360 photos
   of benchmarks/serving.py: CPU per image at each batch size. What is above the best of these is the cost of
   calling the model on smaller batches.
2. The server: one `petal serve` with default flags, driven by benchmarks/serving.py's load generator (closed
   loop, one keep-alive connection per client) at each concurrency, over REST predict, gRPC Predict and V2 binary.
   Over the measured seconds every thread of the server's process tree is read from /proc and its CPU given to a
   group: the worker's event loop (its main thread: reading, parsing, Flask, the codecs, the dataplane, writing, and
   a lone request's model call), TensorFlow's compute threads (`tf_Compute`), the batch threads (`petal-batch-N`),
   gRPC's handler threads (`petal-grpc`: the gate, the servicer, the codec and a lone call's model call), gRPC's
   core threads, and the rest (over gRPC mostly grpcio's Python thread that polls its completion queue). Each
   group's share of the server's CPU is printed as CPU per image.

The two together are the budget: REST ÷ limit of r at some concurrency needs the server's CPU per image at most
(cores - the load generator's share) / (r x the limit's images/s), and the model's share of it is at least its
best-batch CPU per image; the rest is what every other thread may spend. It is one server in one run, so read its
groups against each other, not against another run's.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from serving_benchmark import bench  # noqa: E402  benchmarks/serving.py: its load generator, photos and /proc readers

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MODEL_DIR = os.path.join("exported_models", "flowers")


def model_cpu_per_image(photos: list[bytes], seconds: float) -> dict[int, float]:
    """The model's CPU per image (ms) at each batch size, run as a worker runs it, one caller on the niced pool."""
    from exported_models.model_format import exported_versions
    from serving.process.flags import parse_args
    from serving.process.tensorflow_runtime import configure_tensorflow

    configure_tensorflow(parse_args([f"--model_base_path={MODEL_DIR}", f"--model_name={bench.MODEL}"]))
    version = max(exported_versions(MODEL_DIR))
    call, batch_of = bench.model_call(os.path.join(MODEL_DIR, str(version)), loader=True)
    costs = {}
    for size in BATCH_SIZES:
        batches = [batch_of([photos[(i + j) % len(photos)] for j in range(size)]) for i in range(len(photos))]
        call(batches[0])
        calls, started, cpu = 0, time.monotonic(), time.process_time()
        while time.monotonic() - started < seconds:
            call(batches[calls % len(batches)])
            calls += 1
        costs[size] = 1000 * (time.process_time() - cpu) / (calls * size)
    return costs


def thread_ticks(pid: int) -> dict[tuple[int, int], tuple[str, int]]:
    """(process, thread) -> (group, user + system clock ticks) for every thread of `pid`'s process tree."""
    ticks = {}
    for process in bench.process_tree(pid, bench.process_stats()):
        for task in bench._list(f"/proc/{process}/task"):
            stat = bench._read(f"/proc/{process}/task/{task}/stat")
            if stat:
                fields = stat.rsplit(")", 1)[-1].split()
                group = thread_group(pid, process, int(task), stat[stat.index("(") + 1:stat.rindex(")")])
                ticks[(process, int(task))] = (group, int(fields[11]) + int(fields[12]))
    return ticks


def thread_group(server_pid: int, process: int, thread: int, name: str) -> str:
    if process == server_pid:
        return "master process"
    if thread == process:
        return "event loop"
    if name.startswith("petal-batch"):
        return "batch threads"
    if name == "tf_Compute":
        return "TensorFlow compute"
    if name == "petal-grpc":
        return "gRPC handlers"  # grpcio's pool: the gate, the servicer, the codec and a lone call's model run
    if name.startswith(("grpc", "event_engine", "default-executo")):
        return "gRPC core"
    return "other threads"


def measure(requests, concurrency: int, duration: float, warmup: float) -> tuple[dict, dict[str, float]]:
    """One load-generator run, with the server's CPU over the same seconds split by thread group (shares)."""
    snapshots = []

    def sample() -> None:
        time.sleep(warmup)
        snapshots.append(thread_ticks(requests.server_pid))
        time.sleep(duration)
        snapshots.append(thread_ticks(requests.server_pid))
    sampler = threading.Thread(target=sample)
    sampler.start()  # the load generator's process starts within a few tenths of a second of this
    result = bench.run_loadgen(requests, [concurrency], duration, warmup)[concurrency]
    sampler.join()
    before, after = snapshots
    groups: collections.Counter = collections.Counter()
    for key, (group, ticks) in after.items():
        groups[group] += ticks - before.get(key, (group, 0))[1]
    total = sum(groups.values()) or 1
    return result, {group: ticks / total for group, ticks in groups.items() if ticks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--protocols", default="rest,grpc,v2")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--model_seconds", type=float, default=3.0, help="seconds per batch size in-process")
    args = parser.parse_args()
    from load_tests import launcher
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines

    photos = bench.photo_sets([(480, 360)])["480x360"]
    costs = model_cpu_per_image(photos, args.model_seconds)
    best = min(costs.values())
    print("The model alone, CPU per image (ms) by batch size: "
          + ", ".join(f"{size}: {cost:.2f}" for size, cost in costs.items()))
    with launcher.running([f"--model_name={bench.MODEL}", f"--model_base_path={MODEL_DIR}"], cwd=ROOT) as server:
        bench.wait_for_every_worker(bench.petal_rest_requests(server, photos))
        print("| protocol | concurrency | images/s | server CPU ms/image | by thread group, ms/image | "
              "above the model's best | load generator's cores |")
        print("|---|---|---|---|---|---|---|")
        errors = 0
        for protocol in args.protocols.split(","):
            requests = bench.requests_for(protocol, server, photos)
            for concurrency in map(int, args.concurrency.split(",")):
                result, shares = measure(requests, concurrency, args.duration, args.warmup)
                cpu = result["server_cpu_ms"]
                groups = ", ".join(f"{group} {share * cpu:.2f}"
                                   for group, share in sorted(shares.items(), key=lambda item: -item[1]))
                print(f"| {protocol} | {concurrency} | {result['rps']:.0f} | {cpu:.2f} | {groups} | "
                      f"{cpu - best:.2f} | {result['loadgen_cpu_share']:.2f} |", flush=True)
                errors += result["errors"]
    print(f"errors: {errors}")  # failed calls are left out of each row's images/s and CPU per image
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
