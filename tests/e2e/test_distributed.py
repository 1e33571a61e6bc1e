"""The distributed paths on one CPU: 4 logical devices standing in for a TPU's cores, and two local workers.

Both run in subprocesses, because logical devices and TF_CONFIG must be set before TensorFlow initializes.
"""
import json
import os
import subprocess
import sys

from server_harness import ROOT, free_ports
from training_data import BATCH, NUM_EVAL, SIZE, eval_results, train_args

REPLICAS = 4

LOGICAL_DEVICES = """
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
from training.strategy import per_replica_batch_size
from training.synth import CLASSES
from training.train import TrainConfig, distributed_input, train_and_evaluate

data, output_dir = sys.argv[1:3]
strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
try:
    per_replica_batch_size(BATCH + 2, strategy)
    batch_error = ""
except ValueError as e:
    batch_error = str(e)
config = TrainConfig(train_data_paths=data + "/train-*", eval_data_paths=data + "/eval-*", output_dir=output_dir,
                     labels=CLASSES, image_size=SIZE, train_batch_size=BATCH, eval_batch_size=BATCH, train_steps=6,
                     steps_per_eval=3, steps_per_execution=2, transpose_input=True)
train, _ = distributed_input(strategy, config, training=True)
images, labels = next(iter(train))
evaluation, pipelines = distributed_input(strategy, config, training=False)
eval_shapes, weight = set(), 0.0
for batch in evaluation:
    for replica_images, _, replica_weights in zip(*(strategy.experimental_local_results(t) for t in batch)):
        eval_shapes.add(tuple(replica_images.shape))
        weight += float(tf.reduce_sum(replica_weights))
results = train_and_evaluate(config, strategy)
from training.export import restore_for_export
restored, _ = restore_for_export(output_dir)  # every weight of the transposed run's checkpoint, fed NHWC
exported = tf.saved_model.load(output_dir + "/export/flowers/6").signatures["predict_images"]
probe = tf.random.uniform((2, SIZE, SIZE, 3), seed=1)
export_gap = float(tf.reduce_max(tf.abs(tf.nn.softmax(restored(probe)) - exported(images=probe)["probabilities"])))
import dataclasses
resumed = train_and_evaluate(dataclasses.replace(config, transpose_input=False, train_steps=8, learning_rate=0.25),
                             strategy)
checkpoint = tf.train.load_checkpoint(tf.train.latest_checkpoint(output_dir))
print(json.dumps({
    "export_gap": export_gap, "resumed_step": resumed["step"],
    "resumed_rate": float(checkpoint.get_tensor("optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE")),
    "replicas": strategy.num_replicas_in_sync, "batch_error": batch_error, "pipelines": pipelines,
    "train_shapes": [list(t.shape) for t in strategy.experimental_local_results(images)],
    "label_shapes": [list(t.shape) for t in strategy.experimental_local_results(labels)],
    "eval_shapes": sorted(eval_shapes), "eval_weight": weight, "results": results}))
""".replace("REPLICAS", str(REPLICAS)).replace("BATCH", str(BATCH)).replace("SIZE", str(SIZE))


def test_mirrored_strategy_on_logical_cpu_devices_with_transposed_input(tiny_data, tmp_path):
    run = subprocess.run([sys.executable, "-c", LOGICAL_DEVICES, tiny_data, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    per_replica = BATCH // REPLICAS
    assert report["replicas"] == REPLICAS
    assert "multiple of the number of replicas (4, MirroredStrategy)" in report["batch_error"]
    assert report["train_shapes"] == [[SIZE, SIZE, 3, per_replica]] * REPLICAS, "HWCN per-replica batches"
    assert report["label_shapes"] == [[per_replica]] * REPLICAS
    assert report["eval_shapes"] == [[SIZE, SIZE, 3, per_replica]], "every eval batch full and static"
    assert report["eval_weight"] == NUM_EVAL, "padding rows carry weight 0, real rows weight 1"
    assert report["results"]["step"] == 6 and report["results"]["num_examples"] == NUM_EVAL
    assert report["export_gap"] < 1e-5, "`petal export` restores the transposed run's weights, as its export has them"
    assert report["resumed_step"] == 8, "the run resumes fed NHWC"
    assert report["resumed_rate"] == 0.25, "a resumed run trains at the --learning_rate it is given"
    assert [r["step"] for r in eval_results(tmp_path)] == [3, 6, 8]
    assert os.path.exists(tmp_path / "export" / "flowers" / "6" / "saved_model.pb")


def test_two_workers_with_tf_config_train_and_the_chief_exports(tiny_data, tmp_path):
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    args = train_args(tiny_data, tmp_path, "--train_steps", "4", "--steps_per_eval", "2")
    processes = []
    for index in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}))
        processes.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=300))
    finally:
        for process in processes:
            process.kill()
    for process, (stdout, stderr) in zip(processes, outputs, strict=False):
        assert process.returncode == 0, stdout[-1000:] + stderr[-3000:]
    results = eval_results(tmp_path)
    assert [r["step"] for r in results] == [2, 4], "only the chief appends eval results"
    assert all(r["num_examples"] == NUM_EVAL for r in results)
    assert "eval step 4" in outputs[0][0] and "eval step 4" in outputs[1][0]
    assert "exported" in outputs[0][0] and "exported" not in outputs[1][0]
    assert os.listdir(tmp_path / "export" / "flowers") == ["4"]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".worker")], "worker checkpoints cleaned"
