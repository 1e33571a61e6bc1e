"""Is training ever waiting for input? Training images/s beside input-pipeline images/s, measured in one run.

The recipe's lesson: the accelerator must never wait for the input pipeline, so input_fn must produce batches
at least 2x faster than the training step consumes them (on CPU here; the margin matters more on a TPU). The
training rate is measured on one cached batch, so it is the pure compute rate; the input rate is input_fn alone
with the same batch size and image size. It also prints the exported signature's single-image and batched latency.

    .venv/bin/python benchmarks/train_throughput.py [--data_dir data/tfrecords] [--model compact] [--image_size 64]
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving.tensorflow_logs import import_tensorflow_quietly

import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
import tensorflow as tf  # noqa: E402

from training.export import export_saved_model  # noqa: E402
from training.input import input_fn  # noqa: E402
from training.synth import CLASSES, render  # noqa: E402
from training.train import TrainConfig, Trainer  # noqa: E402


def _write_sample(directory: str, count: int) -> str:
    """A small TFRecord set of real synthetic JPEGs, for machines without `petal tfrecords` output."""
    path = os.path.join(directory, "train-00000-of-00001")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(count):
            feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[render(i % 5, i)])),
                       "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 5]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return path


def _rate(run_batch, batch_size: int, batches: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        run_batch()
    start = time.perf_counter()
    for _ in range(batches):
        run_batch()
    return batches * batch_size / (time.perf_counter() - start)


def _latency_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default="data/tfrecords", help="folder with train-* TFRecords")
    parser.add_argument("--model", default="compact")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=30, help="batches per measurement round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        files = sorted(glob.glob(os.path.join(args.data_dir, "train-*"))) or [_write_sample(scratch, 256)]
        config = TrainConfig(train_data_paths=",".join(files), eval_data_paths=",".join(files),
                             output_dir=os.path.join(scratch, "run"), labels=CLASSES, model=args.model,
                             image_size=args.image_size, train_batch_size=args.batch_size)

        batches = iter(input_fn(files, True, args.batch_size, args.image_size))
        strategy = tf.distribute.get_strategy()
        trainer = Trainer(config, strategy)
        one_batch = input_fn(files, True, args.batch_size, args.image_size).take(1).cache().repeat()
        cached = iter(strategy.distribute_datasets_from_function(lambda _: one_batch))
        steps = tf.constant(1)
        # Alternating rounds, best of each: on a shared machine, noise only ever slows a round down.
        input_rates, train_rates = [], []
        for _ in range(args.rounds):
            input_rates.append(_rate(lambda: next(batches)[0].numpy(), args.batch_size, args.batches))
            train_rates.append(_rate(lambda: trainer.train_steps(cached, steps).numpy(), args.batch_size,
                                     args.batches))
        input_rate, train_rate = max(input_rates), max(train_rates)

        path = export_saved_model(trainer.model, os.path.join(scratch, "export"), list(CLASSES), args.image_size)
        serve = tf.saved_model.load(path).signatures["serving_default"]
        jpeg = render(0, 10_000, size=(320, 240))  # one photo-sized image, so batch and single differ only in count
        single = tf.constant([jpeg])
        batch = tf.constant([jpeg] * args.batch_size)
        single_ms = _latency_ms(lambda: serve(image_bytes=single)["classid"].numpy(), 30)
        batch_ms = _latency_ms(lambda: serve(image_bytes=batch)["classid"].numpy(), 10)

    print(f"model {args.model}, image size {args.image_size}, batch {args.batch_size}, "
          f"{len(files)} TFRecord file(s), {os.cpu_count()} CPUs")
    print(f"input pipeline   {input_rate:9.1f} images/s")
    print(f"training step    {train_rate:9.1f} images/s")
    print(f"input / training {input_rate / train_rate:9.2f}x  (target >= 2x: "
          f"{'OK' if input_rate >= 2 * train_rate else 'INPUT-BOUND'})")
    print(f"serving_default  {single_ms:9.2f} ms for 1 image, {batch_ms:.2f} ms for {args.batch_size} "
          f"({batch_ms / args.batch_size:.2f} ms/image, {single_ms * args.batch_size / batch_ms:.1f}x batching gain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
