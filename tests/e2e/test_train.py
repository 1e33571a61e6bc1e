"""`petal train` through the CLI on a tiny synthetic set: the loop, its outputs, kill -9 and resume, export."""
import glob
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

from server_harness import user_environment
from training_data import NUM_EVAL, PETAL, SIZE, eval_results, train_args


def run(args, timeout=300, env=None):
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def trained(tiny_data, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("run")
    result = run(train_args(tiny_data, output_dir, "--train_steps", "12", "--steps_per_eval", "5",
                            "--steps_per_execution", "2"))
    return output_dir, result.stdout


def test_cli_trains_evaluates_checkpoints_and_exports(trained):
    output_dir, stdout = trained
    results = eval_results(output_dir)
    assert [r["step"] for r in results] == [5, 10, 12]
    assert all(r["num_examples"] == NUM_EVAL for r in results), "eval must see every record exactly once"
    assert all(0.0 <= r["accuracy"] <= 1.0 and np.isfinite(r["loss"]) for r in results)
    assert tf.train.latest_checkpoint(str(output_dir)).endswith("ckpt-12")
    assert os.path.exists(os.path.join(output_dir, "export", "flowers", "12", "saved_model.pb"))
    assert glob.glob(os.path.join(output_dir, "train", "events.out.tfevents.*"))
    assert glob.glob(os.path.join(output_dir, "eval", "events.out.tfevents.*"))
    progress = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert progress[-1].startswith("step 12/12 loss ") and "images/s" in progress[-1]
    assert "eval step 12: loss" in stdout


def test_eval_accuracy_is_the_exported_models_accuracy_on_the_eval_set(trained, tiny_data):
    output_dir, _ = trained
    serve = tf.saved_model.load(os.path.join(output_dir, "export", "flowers", "12")).signatures["serving_default"]
    records = tf.data.TFRecordDataset(sorted(glob.glob(os.path.join(tiny_data, "eval-*"))))
    correct = 0
    for record in records:
        example = tf.train.Example.FromString(record.numpy())
        image = example.features.feature["image/encoded"].bytes_list.value[0]
        label = example.features.feature["image/class/label"].int64_list.value[0]
        correct += int(serve(image_bytes=tf.constant([image]))["classid"][0] == label)
    assert correct / NUM_EVAL == pytest.approx(eval_results(output_dir)[-1]["accuracy"], abs=1e-6)


def test_rerunning_a_finished_run_changes_nothing(trained, tiny_data):
    output_dir, _ = trained
    before = eval_results(output_dir)
    result = run(train_args(tiny_data, output_dir, "--train_steps", "12", "--steps_per_eval", "5"))
    assert "at step 12" in result.stdout and "step 12/12" not in result.stdout
    assert eval_results(output_dir) == before
    assert os.listdir(os.path.join(output_dir, "export", "flowers")) == ["12"]


def test_fewer_train_steps_than_the_run_has_taken_is_one_line(trained, tiny_data):
    """It was a run that did nothing and said nothing."""
    output_dir, _ = trained
    code, lines = fails(train_args(tiny_data, output_dir, "--train_steps", "8"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"petal train: {output_dir} is at step 12, past --train_steps 8: give a larger --train_steps "
                        "to train on, or another --output_dir")


def fails(args) -> tuple[int, list[str]]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=user_environment())
    return result.returncode, result.stderr.splitlines()


def test_a_rerun_as_another_model_says_so_and_leaves_the_run_as_it_was(trained, tiny_data):
    """It failed on the checkpoint's shapes after 28 warning lines, having written its model_config.json over the
    run's, so that `petal export` could no longer read the run's checkpoints."""
    output_dir, _ = trained
    config = (output_dir / "model_config.json").read_bytes()
    code, lines = fails(train_args(tiny_data, output_dir, "--train_steps", "12", "--model", "cnn"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"petal train: {output_dir} holds a run of another model: name 'compact' (now 'cnn')")
    assert (output_dir / "model_config.json").read_bytes() == config


def test_a_damaged_shard_a_missing_tpu_and_an_output_under_a_file_are_one_line_each(tiny_data, tmp_path):
    """Each was a traceback of 14 to 41 lines."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in glob.glob(os.path.join(tiny_data, "*")):
        data = open(path, "rb").read()
        (damaged / os.path.basename(path)).write_bytes(data[:len(data) // 2] if "train-" in path else data)
    code, lines = fails(train_args(str(damaged), tmp_path / "run", "--train_steps", "4"))
    assert code == 1 and len(lines) == 1 and lines[0].startswith("petal train: ") and "truncated" in lines[0], lines
    code, lines = fails(train_args(tiny_data, tmp_path / "tpu", "--use_tpu"))
    assert code == 2 and lines == [lines[0]] and "no TPU to train on at this VM (--use_tpu)" in lines[0], lines
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    code, lines = fails(train_args(tiny_data, a_file / "run"))
    assert code == 1 and len(lines) == 1 and "not a directory" in lines[0], lines


def test_shards_without_records_are_one_line_and_not_a_run_that_never_ends(tiny_data, tmp_path):
    """Empty train shards were repeated for ever and never made a batch: the run hung at full CPU without a word."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in glob.glob(os.path.join(tiny_data, "*")):
        (empty / os.path.basename(path)).write_bytes(b"" if "train-" in path else open(path, "rb").read())
    code, lines = fails(train_args(str(empty), tmp_path / "run", "--train_steps", "4"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("petal train: --train_data_paths ") and "its files hold no records" in lines[0]


def test_warmup_images_that_are_not_images_are_one_line(trained, tmp_path):
    """A folder or a CSV among the matches was a traceback."""
    output_dir, _ = trained
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "labels.csv").write_text("a,b\n")
    code, lines = fails([PETAL, "export", "--checkpoint_dir", str(output_dir), "--export_dir", str(tmp_path / "out"),
                         "--warmup_images", str(tmp_path / "photos" / "*")])
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"petal export: --warmup_images: {tmp_path / 'photos' / 'labels.csv'}: "), lines
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out" / "flowers")


def test_petal_export_from_the_checkpoint_dir(trained, tmp_path):
    output_dir, _ = trained
    result = run([PETAL, "export", "--checkpoint_dir", str(output_dir), "--export_dir", str(tmp_path),
                  "--model_name", "daisies"])
    assert result.stdout.strip() == os.path.join(str(tmp_path), "daisies", "1")
    ours = tf.saved_model.load(os.path.join(tmp_path, "daisies", "1")).signatures["predict_images"]
    trains = tf.saved_model.load(os.path.join(output_dir, "export", "flowers", "12")).signatures["predict_images"]
    images = tf.random.stateless_uniform([2, SIZE, SIZE, 3], [4, 2], -1, 1)
    np.testing.assert_allclose(ours(images=images)["probabilities"], trains(images=images)["probabilities"],
                               rtol=1e-5, atol=1e-6)


def signalled_at_first_checkpoint(args: list[str], output_dir, signum: int) -> tuple[int, str]:
    """Runs `petal train` and sends it `signum` once its first checkpoint is written: its exit status and stderr.
    SIGINT stays at its default in the run, where a background CI shell would have it ignored."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while tf.train.latest_checkpoint(str(output_dir)) is None:
            assert process.poll() is None and time.monotonic() < deadline, "no checkpoint before the deadline"
            time.sleep(0.05)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    return process.returncode, stderr


def test_ctrl_c_is_one_line_and_exit_130(tiny_data, tmp_path):
    """A Ctrl-C was a traceback through Keras and TensorFlow; the run resumes from its checkpoint (the test below)."""
    status, stderr = signalled_at_first_checkpoint(
        train_args(tiny_data, tmp_path, "--train_steps", "400", "--steps_per_eval", "4"), tmp_path, signal.SIGINT)
    assert status == 130
    assert stderr.splitlines()[-1] == "petal train: interrupted; the same command resumes from its last checkpoint"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr


def test_kill_9_then_resume_finishes_at_exactly_train_steps(tiny_data, tmp_path):
    args = train_args(tiny_data, tmp_path, "--train_steps", "40", "--steps_per_eval", "4")
    status, _ = signalled_at_first_checkpoint(args, tmp_path, signal.SIGKILL)
    assert status == -signal.SIGKILL
    killed_at = int(tf.train.latest_checkpoint(str(tmp_path)).rsplit("-", 1)[1])
    assert killed_at < 40
    result = run(args)
    assert f"resumed from {tf.train.latest_checkpoint(str(tmp_path)).rsplit('/', 1)[0]}" in result.stdout
    resumed_at = int(result.stdout.split(" at step ")[1].split()[0])
    assert resumed_at >= killed_at and resumed_at % 4 == 0
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-40")
    steps = [r["step"] for r in eval_results(tmp_path)]
    assert steps[-1] == 40 and sorted(set(steps)) == list(range(4, 41, 4)), "an eval per checkpoint, none lost"
    assert os.listdir(os.path.join(tmp_path, "export", "flowers")) == ["40"]


def test_a_half_written_checkpoint_never_breaks_the_resume(tiny_data, tmp_path):
    run(train_args(tiny_data, tmp_path, "--train_steps", "2", "--steps_per_eval", "2"))
    # What a kill in the middle of a save leaves: data files for step 4, but no entry in the `checkpoint` file.
    for name in ("ckpt-4.index", "ckpt-4.data-00000-of-00001"):
        with open(os.path.join(tmp_path, name), "wb") as f:
            f.write(b"\0garbage")
    result = run(train_args(tiny_data, tmp_path, "--train_steps", "4", "--steps_per_eval", "2"))
    assert "at step 2" in result.stdout
    assert [r["step"] for r in eval_results(tmp_path)] == [2, 4]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-4")


def test_bad_flags_are_clear_errors(tiny_data, tmp_path, capsys):
    from training import export, train
    assert train.main(["--train_data_paths", str(tmp_path / "nope-*"), "--eval_data_paths", str(tmp_path / "nope-*"),
                       "--output_dir", str(tmp_path)]) == 2
    assert "no files match" in capsys.readouterr().err
    train_files = os.path.join(tiny_data, "train-*")
    assert train.main(["--train_data_paths", f"{train_files},{tmp_path / 'trian-*'}", "--eval_data_paths",
                       os.path.join(tiny_data, "eval-*"), "--output_dir", str(tmp_path)]) == 2
    assert f"no files match '{tmp_path / 'trian-*'}' (in '{train_files},{tmp_path / 'trian-*'}')" in (
        capsys.readouterr().err)
    assert train.main(train_args(tiny_data, tmp_path, "--train_steps", "0")[2:]) == 2
    assert "--train_steps must be positive" in capsys.readouterr().err
    assert export.main(["--checkpoint_dir", str(tmp_path), "--export_dir", str(tmp_path / "out")]) == 1
    assert "petal train" in capsys.readouterr().err
