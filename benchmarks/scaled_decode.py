"""The shipped model's CPU per image in-process, this checkout's export against an earlier checkout's, side by side
in one process, by photo size; with --eval_csv, also both exports' top-1 on an eval set.

    .venv/bin/python benchmarks/scaled_decode.py --before ../prev [--rounds 8] [--eval_csv data/flowers/eval_set.csv]

For a change of what the export puts in the graph (since 2026-12-07 a JPEG decodes at the smallest DCT scaling that
still covers the model's input: training/preprocessing.decode_at_least), which benchmarks/request_path.py does not
see: it runs each checkout's code on this checkout's model. Here both versions of `exported_models/flowers` load
through this checkout's loader (serving/core/runtimes.py's Session callable, as Petal's workers call them) with one
intra-op thread (Petal's split), and take turns, a call of each in each round, so the machine's drift falls on both
alike. What is printed is each export's median process CPU per image (TensorFlow's pool threads included), and the
median of the rounds' ratios with their range.
"""
from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import sys

import numpy as np
from tf2_session import per_call_ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL_DIR = os.path.join("exported_models", "flowers")
PHOTOS = 8  # distinct photos per size, cycled through by the calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="an earlier checkout, whose shipped model is compared")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--images", type=int, default=256, help="images per round, export, size and batch size")
    parser.add_argument("--photo_sizes", default="480x360,1024x768")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--eval_csv", help="a `petal synth` split (path,label rows) to compare top-1 on")
    args = parser.parse_args()
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
    import tensorflow as tf

    from exported_models.model_format import class_names, latest_version
    from serving.core import runtimes
    from training.synth import CLASSES, render

    tf.config.threading.set_intra_op_parallelism_threads(1)
    paths = {"this checkout": latest_version(os.path.join(ROOT, MODEL_DIR)),
             os.path.basename(os.path.normpath(args.before)): latest_version(os.path.join(args.before, MODEL_DIR))}
    models = {name: runtimes.load(path, runtimes.LoadOptions()) for name, path in paths.items()}
    (this, before) = models

    def probabilities(name: str, jpegs: list[bytes]) -> np.ndarray:
        return models[name].run("serving_default", {"image_bytes": np.array(jpegs, dtype=object)},
                                ["probabilities"])["probabilities"]

    for name, path in paths.items():
        print(f"{name}: {path}")
    for size in args.photo_sizes.split(","):
        width, height = map(int, size.split("x"))
        photos = [render(CLASSES[i % len(CLASSES)], seed=i, size=(width, height)) for i in range(PHOTOS)]
        for batch in map(int, args.batches.split(",")):
            batches = [(photos * batch)[i:i + batch] for i in range(PHOTOS)]
            calls = max(1, args.images // batch)
            cpu: dict[str, list[float]] = {name: [] for name in models}
            for round_ in range(args.rounds):
                for name in (list(models) if round_ % 2 == 0 else list(reversed(models))):
                    call = functools.partial(probabilities, name, batches[round_ % len(batches)])
                    cpu[name].append(per_call_ms(call, calls)[1] / batch)
            ratios = [a / b for a, b in zip(cpu[this], cpu[before], strict=True)]
            print(f"{size} batch {batch:>2}: process CPU per image (ms), median of {args.rounds} rounds: " + ", ".join(
                f"{name} {statistics.median(each):.3f}" for name, each in cpu.items())
                  + f"; this ÷ {before} {statistics.median(ratios):.2f} (rounds {min(ratios):.2f}–{max(ratios):.2f})")
    if args.eval_csv:
        folder = os.path.dirname(os.path.abspath(args.eval_csv))
        with open(args.eval_csv) as f:
            rows = [(os.path.join(folder, path), label) for path, label in csv.reader(f)]
        labels = np.array([class_names(paths[this]).index(label) for _, label in rows])
        jpegs = [open(path, "rb").read() for path, _ in rows]
        answers = {name: np.concatenate([probabilities(name, jpegs[i:i + 32]) for i in range(0, len(jpegs), 32)])
                   for name in models}
        for name, each in answers.items():
            correct = int((each.argmax(axis=1) == labels).sum())
            print(f"top-1 on {len(rows)} images of {args.eval_csv}: {name} {100 * correct / len(rows):.2f}% "
                  f"({correct} right)")
        agree = float(np.mean(answers[this].argmax(axis=1) == answers[before].argmax(axis=1)))
        print(f"same class {100 * agree:.2f}% of the images; largest probability difference "
              f"{np.abs(answers[this] - answers[before]).max():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
