"""A tiny TFRecord set of real synthetic-flower JPEGs, in the layout `petal tfrecords` writes, for training tests."""
import json
import os
import sys

import tensorflow as tf

from training.synth import CLASSES, render

SIZE = 32
BATCH = 8
NUM_TRAIN, NUM_EVAL = 60, 13  # 13 eval images: not a multiple of the batch, so padding is exercised
PETAL = os.path.join(os.path.dirname(sys.executable), "petal")


def write_tfrecords(directory, num_train=NUM_TRAIN, num_eval=NUM_EVAL):
    """Real JPEGs of the synthetic flowers in the layout `petal tfrecords` writes (shards + labels.txt)."""
    os.makedirs(directory, exist_ok=True)

    def example(index, seed):
        label = index % len(CLASSES)
        feature = {
            "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[render(label, seed, min_size=40, max_size=72)])),
            "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        }
        return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()

    for split, count, shards, offset in (("train", num_train, 2, 0), ("eval", num_eval, 2, 10_000)):
        for shard in range(shards):
            with tf.io.TFRecordWriter(os.path.join(directory, f"{split}-{shard:05d}-of-{shards:05d}")) as writer:
                for i in range(shard, count, shards):
                    writer.write(example(i, offset + i))
    with open(os.path.join(directory, "labels.txt"), "w") as f:
        f.write("\n".join(CLASSES) + "\n")
    return directory


def train_args(data, output_dir, *extra):
    return [PETAL, "train", "--train_data_paths", os.path.join(data, "train-*"),
            "--eval_data_paths", os.path.join(data, "eval-*"), "--output_dir", str(output_dir),
            "--image_size", str(SIZE), "--train_batch_size", str(BATCH), "--num_eval_images", str(NUM_EVAL),
            *extra]


def eval_results(output_dir):
    with open(os.path.join(output_dir, "eval_results.jsonl")) as f:
        return [json.loads(line) for line in f]
