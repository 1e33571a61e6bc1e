"""Is the training input pipeline as fast as decoding allows?

Prints, from one run on the same TFRecord files, the full training pipeline's images/s (training/input.py:
interleave, shuffle, parse, decode, resize, random crop, flip, brightness, contrast, scale, batch, prefetch)
beside a ceiling: parse + decode + resize only, with the same interleave and map parallelism. JPEG decoding is
the cost that cannot be avoided, so the ratio says how much the rest of the pipeline costs. Target: >= 0.8 at
224x224 from ~640x480 JPEGs. The two are timed in alternating rounds so that a busy machine slows both alike.

    .venv/bin/python benchmarks/input_pipeline.py [--num_images 256 --batches 30 --rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving.tensorflow_logs import import_tensorflow_quietly

import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
import tensorflow as tf  # noqa: E402

from training import import_warnings_hidden, synth  # noqa: E402
from training.input import AUTOTUNE, input_fn  # noqa: E402
from training.preprocessing import FEATURES, decode_uint8  # noqa: E402

with import_warnings_hidden():  # training/tfrecords.py imports Beam, which warns of Google Cloud clients it lacks
    from training.tfrecords import example


def write_shards(folder: str, num_images: int, num_shards: int, width: int, height: int) -> str:
    writers = [tf.io.TFRecordWriter(os.path.join(folder, f"train-{i:05d}-of-{num_shards:05d}"))
               for i in range(num_shards)]
    for i in range(num_images):
        label = i % len(synth.CLASSES)
        jpeg = synth.render(label, i, size=(width, height))
        writers[i % num_shards].write(example(jpeg, label, synth.CLASSES[label], f"{i}.jpg", height,
                                              width).SerializeToString())
    for writer in writers:
        writer.close()
    return os.path.join(folder, "train-*")


def ceiling(pattern: str, batch_size: int, image_size: int, cycle_length: int) -> tf.data.Dataset:
    """Decode + resize only (the cheapest way: resizing straight from uint8), with input_fn's interleave and
    map parallelism."""
    def decode_resize(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        parsed = tf.io.parse_single_example(serialized, FEATURES)
        image = tf.image.resize(decode_uint8(parsed["image/encoded"]), [image_size, image_size])
        return image, parsed["image/class/label"]

    files = tf.data.Dataset.list_files(pattern, shuffle=True).repeat()
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=cycle_length, num_parallel_calls=AUTOTUNE,
                               deterministic=False)
    return (records.map(decode_resize, num_parallel_calls=AUTOTUNE, deterministic=False)
            .batch(batch_size, drop_remainder=True).prefetch(AUTOTUNE))


@dataclass
class Rate:
    """Images per wall-clock second, and per CPU-second of this process (all threads): the second is what a
    dedicated machine would turn into images/s, and it stays steady when other jobs share the cores."""

    wall: float
    cpu: float


def measure(data: tf.data.Dataset, batches: int, batch_size: int) -> Rate:
    iterator = iter(data)
    for _ in range(3):  # Warm-up: fill the prefetch and shuffle buffers, let AUTOTUNE settle.
        next(iterator)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(iterator)
    images = batches * batch_size
    return Rate(wall=images / (time.perf_counter() - wall), cpu=images / (time.process_time() - cpu))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_images", type=int, default=256)
    parser.add_argument("--num_shards", type=int, default=8)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=30, help="batches timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycle_length", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(f"writing {args.num_images} {args.width}x{args.height} JPEGs to {args.num_shards} shards ...",
              flush=True)
        pattern = write_shards(folder, args.num_images, args.num_shards, args.width, args.height)
        pipelines = {
            "training pipeline": lambda: input_fn(pattern, training=True, batch_size=args.batch_size,
                                                  image_size=args.image_size, cycle_length=args.cycle_length),
            "decode+resize ceiling": lambda: ceiling(pattern, args.batch_size, args.image_size, args.cycle_length),
        }
        rates: dict[str, list[Rate]] = {name: [] for name in pipelines}
        for round_ in range(1, args.rounds + 1):
            order = list(pipelines.items())
            for name, make in order if round_ % 2 else reversed(order):  # Neither always goes first.
                rate = measure(make(), args.batches, args.batch_size)
                rates[name].append(rate)
                print(f"round {round_}: {name:<22} {rate.wall:8.1f} images/s  {rate.cpu:8.1f} images/CPU-s",
                      flush=True)
    full, top = rates["training pipeline"], rates["decode+resize ceiling"]
    print(f"\nmedian over {args.rounds} rounds, {args.image_size}x{args.image_size} from "
          f"{args.width}x{args.height} JPEGs, batch {args.batch_size}, {os.cpu_count()} CPUs:")
    print(f"  {'':<22} {'images/s':>10} {'images/CPU-s':>14}")
    for name, series in rates.items():
        print(f"  {name:<22} {statistics.median(r.wall for r in series):10.1f} "
              f"{statistics.median(r.cpu for r in series):14.1f}")
    wall_ratio = statistics.median(f.wall / t.wall for f, t in zip(full, top, strict=True))
    cpu_ratio = statistics.median(f.cpu / t.cpu for f, t in zip(full, top, strict=True))
    print(f"  {'ratio (paired rounds)':<22} {wall_ratio:10.2f} {cpu_ratio:14.2f}   target >= 0.80")
    return 0


if __name__ == "__main__":
    sys.exit(main())
