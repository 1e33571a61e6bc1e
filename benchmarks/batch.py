"""Batch job throughput beside the in-process limit, measured side by side in one run (SPEC §8).

The limit is what one process can do with no framework at all: the same host decode (preprocess_eval) and the
`predict_images` signature at the same static batch size, on the same JPEG files. The job is `petal batch` on
the DirectRunner in multi-process mode. The job pays a fixed cost to start its workers, so it runs twice (N
and 2N images): the difference gives the steady-state rate, the larger run the end-to-end rate.

    .venv/bin/python benchmarks/batch.py [--model_dir exported_models/flowers] [--images 1000]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from serving.model_handler import StaticBatchClassifier, read_model_info  # noqa: E402
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


def job_seconds(model_dir: str, pattern: str, output: str, batch_size: int, workers: int) -> float:
    """Wall time of `petal batch` from launch to exit, as a user sees it."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "petal", "batch", "--model_dir", model_dir, "--input", pattern,
                    "--output_dir", output, "--batch_size", str(batch_size), "--direct_running_mode",
                    "multi_processing", "--direct_num_workers", str(workers)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", default=os.path.join(ROOT, "exported_models", "flowers"))
    parser.add_argument("--images", type=int, default=1000, help="N; the job also runs on 2N")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = model_dir_or_untrained(args.model_dir, workdir)
        small = write_jpegs(os.path.join(workdir, "small"), args.images)
        large = small + write_jpegs(os.path.join(workdir, "large"), args.images)
        for path in small:
            os.link(path, os.path.join(workdir, "large", "a" + os.path.basename(path)))
        large = sorted(glob.glob(os.path.join(workdir, "large", "*.jpg")))
        limit = in_process_rate(model_dir, large, args.batch_size)
        t_small = job_seconds(model_dir, os.path.join(workdir, "small", "*.jpg"), os.path.join(workdir, "o1"),
                              args.batch_size, args.workers)
        t_large = job_seconds(model_dir, os.path.join(workdir, "large", "*.jpg"), os.path.join(workdir, "o2"),
                              args.batch_size, args.workers)
    steady = args.images / (t_large - t_small)
    end_to_end = len(large) / t_large
    print(json.dumps({"model": model_dir, "images": len(large), "batch_size": args.batch_size,
                      "workers": args.workers, "in_process_limit_images_per_s": round(limit, 1),
                      "job_steady_images_per_s": round(steady, 1), "job_end_to_end_images_per_s": round(end_to_end, 1),
                      "job_startup_s": round(t_small - args.images / steady, 1)}))
    print(f"steady-state job / in-process limit = {steady / limit:.2f} (target >= 0.7); "
          f"end-to-end incl. startup = {end_to_end / limit:.2f}")


if __name__ == "__main__":
    main()
