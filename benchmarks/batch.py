"""Batch job throughput of both engines beside the in-process limit, measured side by side in one run.

The limit is what one process can do with no framework at all: the same host decode (preprocess_eval) and the
`predict_images` signature at the same static batch size, on the same JPEG files. The jobs are `petal batch` on
Beam's DirectRunner in multi-process mode and on Spark's `local[N]`, each with every worker count asked for.
Workers pay a fixed start-up cost, so a job's rate is its processing rate from its own summary (Beam: first
decode to last row out; Spark: first task's start after its model loaded to last task's end, across all
workers); the end-to-end rate including start-up is printed too. The limit is measured before and after the jobs
and averaged, so a load change on a shared machine hits both sides alike.

    .venv/bin/python benchmarks/batch.py [--model_dir exported_models/flowers] [--images 2000] [--workers 1,2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from serving.tensorflow_logs import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
import tensorflow as tf  # noqa: E402

from serving.batch_prediction.steps import StaticBatchClassifier, read_model_info  # noqa: E402
from training import synth  # noqa: E402
from training.preprocessing import preprocess_eval  # noqa: E402


def model_dir_or_untrained(model_dir: str, workdir: str) -> str:
    """Throughput does not depend on the weights, so an untrained default model stands in before training."""
    if os.path.isdir(model_dir):
        return model_dir
    from training.export import export_saved_model
    from training.models import build_model

    print(f"{model_dir} not found; benchmarking an untrained 'compact' model at 64 px", file=sys.stderr)
    base = os.path.join(workdir, "model")
    export_saved_model(build_model("compact", len(synth.CLASSES), 64), base, list(synth.CLASSES), 64, version=1)
    return base


def write_jpegs(folder: str, count: int) -> list[str]:
    os.makedirs(folder)
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"flower{i:05d}.jpg")
        with open(path, "wb") as f:
            f.write(synth.render(i % len(synth.CLASSES), i, min_size=160, max_size=320))
        paths.append(path)
    return paths


def in_process_rate(model_dir: str, paths: list[str], batch_size: int) -> float:
    """Images/s of read + host decode + predict_images on static batches, in this one process."""
    info = read_model_info(model_dir)
    classifier = StaticBatchClassifier(info, batch_size)
    decode = tf.function(lambda data: preprocess_eval(data, info.height, info.width),
                         input_signature=[tf.TensorSpec([], tf.string)])

    def run(batch_paths: list[str]) -> None:
        images = []
        for path in batch_paths:
            with open(path, "rb") as f:
                images.append(decode(f.read()).numpy())
        classifier.predict(np.stack(images))

    run(paths[:batch_size])
    started = time.perf_counter()
    for start in range(0, len(paths), batch_size):
        run(paths[start:start + batch_size])
    return len(paths) / (time.perf_counter() - started)


def engine_flags(engine: str, workers: int, images: int, batch_size: int) -> list[str]:
    """Beam's multi-process DirectRunner, or Spark's local[N] with four tasks a worker (whole batches each)."""
    if engine == "beam":
        return ["--direct_running_mode", "multi_processing", "--direct_num_workers", str(workers)]
    rows = max(batch_size, -(-images // (4 * workers * batch_size)) * batch_size)
    return ["--engine=spark", "--spark_master", f"local[{workers}]", "--rows_per_partition", str(rows)]


def run_job(model_dir: str, pattern: str, output: str, batch_size: int, flags: list[str]) -> tuple[dict, float]:
    """`petal batch` as a user runs it: its printed summary, and its wall time from launch to exit."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "petal", "batch", "--model_dir", model_dir, "--input", pattern,
                           "--output_dir", output, "--batch_size", str(batch_size), *flags],
                          check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", default=os.path.join(ROOT, "exported_models", "flowers"))
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts, each run on each engine")
    parser.add_argument("--engines", default="beam,spark")
    args = parser.parse_args()
    runs = [(engine, int(workers)) for engine in args.engines.split(",") for workers in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = model_dir_or_untrained(args.model_dir, workdir)
        paths = write_jpegs(os.path.join(workdir, "images"), args.images)
        limit_before = in_process_rate(model_dir, paths, args.batch_size)
        jobs = [(engine, workers, *run_job(model_dir, os.path.join(workdir, "images", "*.jpg"),
                                           os.path.join(workdir, f"out-{engine}-{workers}"), args.batch_size,
                                           engine_flags(engine, workers, args.images, args.batch_size)))
                for engine, workers in runs]
        limit = (limit_before + in_process_rate(model_dir, paths, args.batch_size)) / 2
    print(json.dumps({"model": jobs[0][2]["model"], "images": args.images, "batch_size": args.batch_size,
                      "in_process_limit_images_per_s": round(limit, 1)}))
    for engine, workers, summary, wall in jobs:
        assert summary["complete"] and summary["results"] == args.images, summary
        job = summary["images_per_s"]
        print(json.dumps({"engine": engine, "workers": workers, "job_images_per_s": job, "job_wall_s": round(wall, 1),
                          "job_end_to_end_images_per_s": round(args.images / wall, 1),
                          "job_over_limit": round(job / limit, 2),
                          "end_to_end_over_limit": round(args.images / wall / limit, 2)}))


if __name__ == "__main__":
    main()
