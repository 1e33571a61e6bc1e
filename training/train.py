"""`petal train`: the recipe's train-and-evaluate loop on tf.distribute, resumable after a kill.

Train to the next checkpoint boundary, save (model, optimizer, step), evaluate the whole eval set, repeat until
--train_steps, then export. The loop is the same for the default strategy, several GPUs, several workers and a TPU;
only `resolve_strategy` differs. A checkpoint is the unit of progress: a run killed at any point and started again
restores the latest complete checkpoint and ends at exactly --train_steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass

import keras
import tensorflow as tf

from exported_models.model_format import DEFAULT_MODEL_NAME, LABELS_FILE, read_labels
from training.export import MAX_WARMUP_IMAGES, export_saved_model, what_failed
from training.input import input_fn
from training.models import CONFIG_FILE, DEFAULT_MODEL, MODEL_NAMES, ModelConfig, fed_transposed
from training.preprocessing import FEATURES
from training.strategy import MIXED_PRECISION, is_chief, per_replica_batch_size, resolve_strategy, set_mixed_precision

log = logging.getLogger(__name__)

EVAL_RESULTS = "eval_results.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """Everything the loop needs besides the strategy; the CLI flags map onto it one to one."""

    train_data_paths: str
    eval_data_paths: str
    output_dir: str
    labels: tuple[str, ...]
    model: str = DEFAULT_MODEL
    image_size: int = 64
    batch_norm: bool = False
    train_steps: int = 1000
    train_batch_size: int = 64
    eval_batch_size: int = 64
    learning_rate: float = 1e-3
    steps_per_eval: int = 100
    steps_per_execution: int = 1
    transpose_input: bool = False
    num_train_images: int | None = None
    num_eval_images: int | None = None
    model_name: str = DEFAULT_MODEL_NAME

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(self.model, self.labels, self.image_size, self.batch_norm)


def _files(pattern: str) -> list[str]:
    """Every file of a comma-separated list of patterns, each of which must match: a mistyped part
    (`train-*,trian-extra-*`) was dropped without a word, and the run trained on part of its data."""
    files = []
    for part in filter(None, (p.strip() for p in pattern.split(","))):
        matched = tf.io.gfile.glob(part)
        if not matched:
            raise FileNotFoundError(f"no files match {part!r}" + (f" (in {pattern!r})" if part != pattern else ""))
        files += matched
    if not files:
        raise FileNotFoundError(f"no files match {pattern!r}")
    return sorted(files)


def check_records(pattern: str, flag: str) -> None:
    """Refuse a pattern whose files hold no record: a training set of empty shards repeated for ever and never made
    a batch, so the run hung without a word, and an empty eval set was recorded as accuracy 0."""
    if next(iter(tf.data.TFRecordDataset(_files(pattern)).take(1)), None) is None:
        raise ValueError(f"{flag} {pattern!r}: its files hold no records")


def distributed_input(strategy: tf.distribute.Strategy, config: TrainConfig,
                       training: bool) -> tuple[tf.distribute.DistributedDataset, int]:
    """Per-replica batches, one input pipeline per worker; returns the dataset and the number of pipelines.

    Training shards the files across workers when there are enough of them. Eval gives every worker the whole
    eval set: the workers must run the same number of steps, and since weights and sums are both counted once per
    worker, the reported ratios stay exact. Eval batches are padded with weight-0 batches to a multiple of the
    local replica count, so every replica always gets a full, static-shape batch.
    """
    files = _files(config.train_data_paths if training else config.eval_data_paths)
    global_batch = config.train_batch_size if training else config.eval_batch_size
    per_replica_batch_size(global_batch, strategy)
    pipelines = []

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        pipelines.append(context.num_input_pipelines)
        batch = context.get_per_replica_batch_size(global_batch)
        mine = files
        if training and len(files) >= context.num_input_pipelines > 1:
            mine = files[context.input_pipeline_id::context.num_input_pipelines]
        data = input_fn(mine, training, batch, config.image_size, transpose=config.transpose_input,
                        pad_eval_batches=not training)
        if training:
            return data
        local_replicas = context.num_replicas_in_sync // context.num_input_pipelines
        padding = tf.data.Dataset.from_tensors(
            tuple(tf.zeros(spec.shape, spec.dtype) for spec in data.element_spec)).repeat(local_replicas - 1)
        return data.concatenate(padding).batch(local_replicas, drop_remainder=True).unbatch()

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    return dataset, max(pipelines, default=1)


class Trainer:
    """The model, optimizer, step counter and compiled step functions under one strategy."""

    def __init__(self, config: TrainConfig, strategy: tf.distribute.Strategy):
        self.config = config
        self.strategy = strategy
        self.chief = is_chief(strategy)
        with strategy.scope():
            self.model = config.model_config.build()  # NHWC: what the checkpoints and the export hold
            self.fed = fed_transposed(self.model) if config.transpose_input else self.model
            self.optimizer = keras.optimizers.Adam(config.learning_rate)
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
        directory = config.output_dir if self.chief else os.path.join(
            config.output_dir, f".worker-{strategy.cluster_resolver.task_id}")
        self.manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=3)

    def restore(self) -> int:
        """Restore the latest complete checkpoint of the chief's directory (a half-written one is never listed)."""
        latest = tf.train.latest_checkpoint(self.config.output_dir)
        if latest:
            self.manager.checkpoint.restore(latest).assert_existing_objects_matched()
            # Keras keeps the rate in an optimizer variable, which the restore just set to the run's first
            # --learning_rate; the flag given now is what the steps ahead use, as task.py's rate was on a resume.
            self.optimizer.learning_rate.assign(self.config.learning_rate)
            print(f"resumed from {latest} at step {int(self.step.numpy())}", flush=True)
        return int(self.step.numpy())

    def save(self) -> None:
        self.manager.save(checkpoint_number=self.step)
        if not self.chief:
            shutil.rmtree(self.manager.directory, ignore_errors=True)

    def _train_step(self, images, labels):
        with tf.GradientTape() as tape:
            logits = self.fed(images, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.config.train_batch_size)
        gradients = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_steps(self, iterator, steps: tf.Tensor) -> tf.Tensor:
        """`steps` steps in one call: --steps_per_execution, the recipe's iterations_per_loop."""
        loss = tf.constant(0.0)
        for _ in tf.range(steps):
            per_replica = self.strategy.run(self._train_step, args=next(iterator))
            loss = self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        self.step.assign_add(tf.cast(steps, tf.int64))
        return loss

    def _eval_step(self, images, labels, weights):
        logits = self.fed(images, training=False)
        per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels), tf.float32)
        return tf.stack([tf.reduce_sum(per_example * weights), tf.reduce_sum(correct * weights),
                         tf.reduce_sum(weights)])

    @tf.function
    def eval_step(self, batch) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(self._eval_step, args=batch),
                                    axis=None)

    def evaluate(self, dataset, pipelines: int) -> dict:
        """Loss and accuracy over the whole eval set; each pipeline saw all of it, hence the division."""
        totals = tf.zeros([3])
        for batch in dataset:
            totals += self.eval_step(batch)
        loss_sum, correct, count = totals.numpy().tolist()
        return {"step": int(self.step.numpy()), "loss": loss_sum / max(count, 1.0),
                "accuracy": correct / max(count, 1.0), "num_examples": int(round(count / pipelines))}


def _eval_lines(output_dir: str) -> list[str]:
    """eval_results.jsonl's lines, through tf.io.gfile so that gs:// output dirs (Cloud TPU) work too."""
    path = os.path.join(output_dir, EVAL_RESULTS)
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        return [line for line in f.read().splitlines() if line.strip()]


def _last_eval_step(output_dir: str) -> int | None:
    lines = _eval_lines(output_dir)
    return json.loads(lines[-1])["step"] if lines else None


def _record_eval(trainer: Trainer, results: dict, writer) -> None:
    config = trainer.config
    if config.num_eval_images and results["num_examples"] != config.num_eval_images:
        log.warning("eval count differs from --num_eval_images",
                    extra={"fields": {"counted": results["num_examples"], "expected": config.num_eval_images}})
    print(f"eval step {results['step']}: loss {results['loss']:.4f} accuracy {results['accuracy']:.4f} "
          f"({results['num_examples']} images)", flush=True)
    if not trainer.chief:
        return
    lines = _eval_lines(config.output_dir) + [json.dumps({**results, "time": round(time.time(), 3)})]
    write_whole(os.path.join(config.output_dir, EVAL_RESULTS), "\n".join(lines) + "\n")
    with writer.as_default(step=results["step"]):
        tf.summary.scalar("loss", results["loss"])
        tf.summary.scalar("accuracy", results["accuracy"])
    writer.flush()


def write_whole(path: str, text: str) -> None:
    """Replace the file at `path` with `text` in one rename, so a kill at any moment leaves the old file or the new
    one, never a truncated one (object stores cannot append, so the eval history is rewritten each time; written in
    place, a kill mid-write lost it all)."""
    staging = f"{path}.tmp"
    with tf.io.gfile.GFile(staging, "w") as f:
        f.write(text)
    tf.io.gfile.rename(staging, path, overwrite=True)


def _eval_images(config: TrainConfig, count: int) -> list[bytes]:
    """The first few eval images: real inputs for the export's warmup requests."""
    records = tf.data.TFRecordDataset(_files(config.eval_data_paths)).take(count)
    return [tf.io.parse_single_example(r, FEATURES)["image/encoded"].numpy() for r in records]


def export(trainer: Trainer) -> str | None:
    """Chief only: a float32, NHWC copy of the weights as version <global step>, unless that version exists."""
    config = trainer.config
    base = os.path.join(config.output_dir, "export", config.model_name)
    version = int(trainer.step.numpy())
    if not trainer.chief or tf.io.gfile.isdir(os.path.join(base, str(version))):
        return None
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        model = config.model_config.build()
        model.set_weights(trainer.model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy(policy)
    path = export_saved_model(model, base, list(config.labels), config.image_size, version=version,
                              warmup_images=_eval_images(config, MAX_WARMUP_IMAGES))
    print(f"exported {path}", flush=True)
    return path


def check_same_model(config: TrainConfig) -> None:
    """A run resumes only as the model it began as. A rerun with another --model, --image_size, --batch_norm or
    labels failed on the checkpoint's shapes, after it had written its own model_config.json over the run's, so
    that `petal export` could no longer read the checkpoints that were there."""
    if not tf.io.gfile.exists(os.path.join(config.output_dir, CONFIG_FILE)):
        return
    saved = ModelConfig.load(config.output_dir)
    if saved != config.model_config:
        differ = [f"{f.name} {getattr(saved, f.name)!r} (now {getattr(config.model_config, f.name)!r})"
                  for f in dataclasses.fields(ModelConfig)
                  if getattr(saved, f.name) != getattr(config.model_config, f.name)]
        raise ValueError(f"{config.output_dir} holds a run of another model: {', '.join(differ)}; rerun it with "
                         "the flags it began with, or give another --output_dir")


def train_and_evaluate(config: TrainConfig, strategy: tf.distribute.Strategy) -> dict | None:
    """Run (or resume) training to exactly config.train_steps; returns the last eval results."""
    tf.io.gfile.makedirs(config.output_dir)
    check_same_model(config)
    trainer = Trainer(config, strategy)
    if trainer.chief:
        config.model_config.save(config.output_dir)
    step = trainer.restore()
    if step > config.train_steps:  # it did nothing and said nothing
        raise ValueError(f"{config.output_dir} is at step {step}, past --train_steps {config.train_steps}: give a "
                         "larger --train_steps to train on, or another --output_dir")
    train_data = iter(distributed_input(strategy, config, training=True)[0])
    eval_data, eval_pipelines = distributed_input(strategy, config, training=False)
    writers = ({name: tf.summary.create_file_writer(os.path.join(config.output_dir, name))
                for name in ("train", "eval")} if trainer.chief else
               {name: tf.summary.create_noop_writer() for name in ("train", "eval")})
    results = None
    if step > 0 and _last_eval_step(config.output_dir) != step:
        results = trainer.evaluate(eval_data, eval_pipelines)
        _record_eval(trainer, results, writers["eval"])
    epoch_images = config.num_train_images
    last_print, images_since, since = 0.0, 0, time.perf_counter()
    while step < config.train_steps:
        boundary = min((step // config.steps_per_eval + 1) * config.steps_per_eval, config.train_steps)
        while step < boundary:
            steps = min(config.steps_per_execution, boundary - step)
            loss = float(trainer.train_steps(train_data, tf.constant(steps)))
            step += steps
            images_since += steps * config.train_batch_size
            now = time.perf_counter()
            if now - last_print >= 5 or step == boundary:
                rate = images_since / max(now - since, 1e-9)
                epochs = f" epoch {step * config.train_batch_size / epoch_images:.2f}" if epoch_images else ""
                print(f"step {step}/{config.train_steps} loss {loss:.4f} images/s {rate:.1f}{epochs}", flush=True)
                with writers["train"].as_default(step=step):
                    tf.summary.scalar("loss", loss)
                    tf.summary.scalar("images_per_second", rate)
                last_print, images_since, since = now, 0, now
        trainer.save()
        results = trainer.evaluate(eval_data, eval_pipelines)
        _record_eval(trainer, results, writers["eval"])
    export(trainer)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="petal train", description=__doc__.split("\n\n")[0])
    p.add_argument("--train_data_paths", required=True, help="TFRecord glob(s), comma separated, e.g. data/train-*")
    p.add_argument("--eval_data_paths", required=True, help="TFRecord glob(s), comma separated, e.g. data/eval-*")
    p.add_argument("--output_dir", required=True, help="checkpoints, eval_results.jsonl, TensorBoard, export/")
    p.add_argument("--labels_file", help="default: labels.txt beside the first training file")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODEL_NAMES)
    p.add_argument("--image_size", type=int, default=64)
    p.add_argument("--batch_norm", action="store_true", help="batch norm in the cnn's dense layer")
    p.add_argument("--train_steps", type=int, default=1000)
    p.add_argument("--train_batch_size", type=int, default=64, help="global batch, a multiple of the replicas")
    p.add_argument("--eval_batch_size", type=int, default=None, help="default: --train_batch_size")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--steps_per_eval", type=int, default=100, help="checkpoint and evaluate every N steps")
    p.add_argument("--steps_per_execution", type=int, default=1, help="steps per device call (iterations_per_loop)")
    p.add_argument("--transpose_input", action="store_true", help="feed HWCN batches (faster on TPU)")
    p.add_argument("--mixed_precision", default="none", choices=tuple(MIXED_PRECISION))
    p.add_argument("--use_tpu", action="store_true", help="the TPU attached to this VM, unless --tpu names one")
    p.add_argument("--tpu", default=None, help="Cloud TPU name or grpc:// address")
    p.add_argument("--tpu_zone", default=None)
    p.add_argument("--project", default=None)
    p.add_argument("--num_train_images", type=int, default=None, help="for the epoch count in progress lines")
    p.add_argument("--num_eval_images", type=int, default=None, help="warn if eval counts a different number")
    p.add_argument("--model_name", default=DEFAULT_MODEL_NAME, help="exports to <output_dir>/export/<model_name>/")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("train_steps", "train_batch_size", "steps_per_eval", "steps_per_execution", "image_size"):
        if getattr(args, flag) <= 0:
            print(f"petal train: --{flag} must be positive", file=sys.stderr)
            return 2
    try:
        labels_file = args.labels_file or os.path.join(
            os.path.dirname(_files(args.train_data_paths)[0]), LABELS_FILE)
        config = TrainConfig(
            train_data_paths=args.train_data_paths, eval_data_paths=args.eval_data_paths,
            output_dir=args.output_dir, labels=tuple(read_labels(labels_file)), model=args.model,
            image_size=args.image_size, batch_norm=args.batch_norm, train_steps=args.train_steps,
            train_batch_size=args.train_batch_size, eval_batch_size=args.eval_batch_size or args.train_batch_size,
            learning_rate=args.learning_rate, steps_per_eval=args.steps_per_eval,
            steps_per_execution=args.steps_per_execution, transpose_input=args.transpose_input,
            num_train_images=args.num_train_images, num_eval_images=args.num_eval_images,
            model_name=args.model_name)
        set_mixed_precision(args.mixed_precision)
        strategy = resolve_strategy(args.tpu, args.use_tpu, args.tpu_zone, args.project)
        per_replica_batch_size(config.train_batch_size, strategy)
        per_replica_batch_size(config.eval_batch_size, strategy)
        check_records(args.train_data_paths, "--train_data_paths")  # after the strategy: a multi-worker one must
        check_records(args.eval_data_paths, "--eval_data_paths")  # configure TensorFlow before its first op
        train_and_evaluate(config, strategy)
    except (OSError, ValueError) as e:
        print(f"petal train: {e}", file=sys.stderr)
        return 2
    except tf.errors.OpError as e:  # a damaged TFRecord file mid-run, an --output_dir under a file
        print(f"petal train: {what_failed(e.message)}", file=sys.stderr)
        return 1
    return 0
