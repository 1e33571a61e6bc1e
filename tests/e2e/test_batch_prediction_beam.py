"""`petal batch` end to end: real JPEGs on disk, a real exported SavedModel, the real Beam DirectRunner."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest
import tensorflow as tf

from batch_jobs import (
    FAIL_FAST_S,
    assert_cut_tails_are_one_error_each,
    assert_each_fails_fast_in_one_line,
    assert_nothing_lost,
    assert_one_error_line,
    failing_jobs,
    keras_tripwire,
    read_output,
    run_job,
    write_cut_tfrecords,
    write_jsonl_input,
    write_tfrecord_input,
)
from exported_models.model_format import DEFAULT_MODEL_BASE_PATH as SHIPPED_MODEL
from load_tests.pixel_flood import flat_jpeg
from server_harness import ROOT, TF_NATIVE_LOG, b64, run_server, user_environment
from serving.batch_prediction import job as batch_job
from serving.batch_prediction import model_handler, preflight, spark_job
from serving.batch_prediction.cli import SPARK_ONLY_FLAGS
from training import PROGRESS_LOGGER, synth
from training.export import export_saved_model
from training.models import build_model

IMAGE_SIZE = 32
GOOD_JPEGS = 99
IN_MEMORY = ["--direct_running_mode", "in_memory"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    base = str(tmp_path_factory.mktemp("models") / "flowers")
    tf.keras.utils.set_random_seed(7)
    model = build_model("compact", len(synth.CLASSES), IMAGE_SIZE)
    export_saved_model(model, base, list(synth.CLASSES), IMAGE_SIZE, version=1)
    return base


def _png() -> bytes:
    buffer = io.BytesIO()
    synth.render_image("roses", 1, min_size=40, max_size=60).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> dict[str, bytes]:
    """103 files: 99 JPEGs, a PNG (decodable, so predicted) and three inputs that must become error lines."""
    folder = tmp_path_factory.mktemp("images")
    jpeg = synth.render("daisy", 0, min_size=40, max_size=64)
    files = {f"flower{i:03d}.jpg": synth.render(i % 5, i, min_size=40, max_size=64) for i in range(GOOD_JPEGS)}
    files.update({"rose.png": _png(), "corrupt.jpg": jpeg[:20] + bytes(len(jpeg) - 20), "empty.jpg": b"",
                  "notes.jpg": b"this is a text file, not an image\n"})
    paths = {}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        paths[str(folder / name)] = data
    return paths


EXPECTED_ERRORS = {"corrupt.jpg": "Invalid JPEG data", "empty.jpg": "Input is empty",
                   "notes.jpg": "Unknown image file format"}


def serving_default(model_dir: str, images: list[bytes]) -> dict[str, np.ndarray]:
    """What the online server runs: the SavedModel's serving_default signature on the raw bytes."""
    signature = tf.saved_model.load(f"{model_dir}/1").signatures["serving_default"]
    return {k: v.numpy() for k, v in signature(image_bytes=tf.constant(images)).items()}


@pytest.fixture(scope="session")
def reference(model_dir, inputs) -> dict[str, dict]:
    """serving_default's answer for every decodable input, by path."""
    good = [p for p in inputs if os.path.basename(p) not in EXPECTED_ERRORS]
    outputs = serving_default(model_dir, [inputs[p] for p in good])
    return {p: {"probabilities": outputs["probabilities"][i], "classid": int(outputs["classid"][i]),
                "class": outputs["class"][i].decode()} for i, p in enumerate(good)}


def assert_matches_reference(results: list[dict], reference: dict[str, dict], key_to_path=lambda key: key):
    for row in results:
        expected = reference[key_to_path(row["key"])]
        prediction = row["prediction"]
        np.testing.assert_allclose(prediction["probabilities"], expected["probabilities"], atol=1e-5)
        assert (prediction["classid"], prediction["class"]) == (expected["classid"], expected["class"])


@pytest.fixture(scope="session")
def image_job(model_dir, inputs, tmp_path_factory):
    output = str(tmp_path_factory.mktemp("job") / "out")
    argv = ["--model_dir", model_dir, "--input", os.path.join(os.path.dirname(next(iter(inputs))), "*"),
            "--output_dir", output, "--batch_size", "16", "--top_k", "2", *IN_MEMORY]
    args, options = batch_job.parse_args(argv)
    return output, batch_job.run(args, options)


def test_103_inputs_give_results_plus_errors_with_every_key_once(image_job, inputs):
    output, summary = image_job
    assert (summary["rows_in"], summary["results"], summary["errors"], summary["complete"]) == (103, 100, 3, True)
    results, errors = read_output(output)
    assert len(results) + len(errors) == len(inputs) == 103
    assert_nothing_lost(results, errors, inputs)
    assert {os.path.basename(row["key"]): row["error"]["status"] for row in errors} == dict.fromkeys(
        EXPECTED_ERRORS, "INVALID_ARGUMENT")
    for row in errors:
        assert EXPECTED_ERRORS[os.path.basename(row["key"])] in row["error"]["message"]
    assert any(row["key"].endswith("rose.png") for row in results), "a PNG is an image and must be predicted"


def test_every_batch_is_full_and_padding_never_reaches_the_output(image_job):
    _, summary = image_job
    assert summary["padding_rows"] > 0
    assert summary["batches"] * 16 == summary["results"] + summary["padding_rows"]


def test_top_k_lists_the_best_labels_in_order(image_job):
    results, _ = read_output(image_job[0])
    assert len(results) == 100
    for row in results:
        prediction = row["prediction"]
        scores = [entry["score"] for entry in prediction["top_k"]]
        assert len(scores) == 2 and scores[0] >= scores[1] and scores[0] == max(prediction["probabilities"])
        assert prediction["top_k"][0]["label"] == prediction["class"]


def test_predictions_equal_the_serving_default_signature(image_job, reference):
    results, _ = read_output(image_job[0])
    assert len(results) == len(reference)
    assert_matches_reference(results, reference)


def _filelist(path: str, inputs: dict[str, bytes], paths: list[str]) -> list[str]:
    missing = os.path.join(os.path.dirname(path), "missing.jpg")
    with open(path, "w") as f:
        f.write("\n".join(paths + ["missing.jpg", ""]) + "\n")
    return paths + [missing]


@pytest.mark.parametrize("name, writer, bad_status", [
    ("images.tfrecord", write_tfrecord_input, {"INVALID_ARGUMENT"}),
    ("images.jsonl", write_jsonl_input, {"INVALID_ARGUMENT"}),
    ("images.txt", _filelist, {"NOT_FOUND"}),
])
def test_each_input_format_is_read_keyed_and_predicted(name, writer, bad_status, model_dir, inputs, reference,
                                                       tmp_path, capsys):
    good = sorted(reference)[:11]
    source = str(tmp_path / name)
    expected_keys = writer(source, inputs, good)
    output = str(tmp_path / "out")
    summary = run_job(capsys, "--model_dir", model_dir, "--input", source, "--output_dir", output,
                      "--batch_size", "4", *IN_MEMORY)
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, expected_keys)
    assert summary["rows_in"] == len(expected_keys) and summary["complete"]
    assert {row["error"]["status"] for row in errors} == bad_status
    tfrecord_first = f"{source}:0"
    assert_matches_reference(results, reference, lambda key: good[0] if key == tfrecord_first else key)


def test_tfrecords_cut_in_a_header_or_in_a_body_give_one_error_each_on_the_fnapi_runner(
        model_dir, inputs, reference, tmp_path, capsys):
    pattern, keys, cuts = write_cut_tfrecords(tmp_path, inputs, sorted(reference)[:9])
    output = str(tmp_path / "out")
    summary = run_job(capsys, "--model_dir", model_dir, "--input", pattern, "--output_dir", output,
                      "--batch_size", "4", "--runner", "FnApiRunner")
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, keys)
    assert summary["rows_in"] == summary["results"] + summary["errors"] == len(keys) and summary["complete"]
    assert_cut_tails_are_one_error_each(errors, cuts)


def test_rerun_refuses_a_used_output_dir_unless_overwrite(model_dir, inputs, tmp_path, capsys):
    some = sorted(inputs)[:3]
    (tmp_path / "in").mkdir()
    for path in some:
        (tmp_path / "in" / os.path.basename(path)).write_bytes(inputs[path])
    output = tmp_path / "out"
    argv = ["--model_dir", model_dir, "--input", str(tmp_path / "in" / "*"), "--output_dir", str(output),
            *IN_MEMORY]
    run_job(capsys, *argv)
    stale = output / "prediction.results-00007-of-00009"
    stale.write_text('{"key": "from an older run"}\n')
    before = sorted(os.listdir(output))

    assert batch_job.main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(output)) == before

    run_job(capsys, *argv, "--overwrite")
    assert not stale.exists()
    results, errors = read_output(str(output))
    assert_nothing_lost(results, errors, [str(tmp_path / "in" / os.path.basename(p)) for p in some])


def test_cli_rejects_bad_flags(model_dir, capsys):
    with pytest.raises(SystemExit):
        batch_job.parse_args(["--model_dir", model_dir, "--input", "x", "--output_dir", "o", "--batch_size", "0"])
    assert "--batch_size must be at least 1" in capsys.readouterr().err
    for flag in SPARK_ONLY_FLAGS:  # Beam took them as pipeline options, discarded them with a warning, and ran
        with pytest.raises(SystemExit):
            batch_job.parse_args(["--model_dir", model_dir, "--input", "x", "--output_dir", "o", f"{flag}=1"])
        assert f"{flag}: the Spark job's, not Beam's; add --engine=spark" in capsys.readouterr().err


def test_an_image_over_max_image_pixels_is_an_error_row_and_never_decoded(model_dir, inputs, tmp_path, capsys):
    """A real 49 Mpx JPEG (0.7 MB, flat colour) is over the default limit, the server's; the flag reaches the
    workers (a limit of 100 pixels refuses the small photos too); 0 is refused before the job starts."""
    folder = tmp_path / "in"
    folder.mkdir()
    photos = sorted(p for p in inputs if os.path.basename(p).startswith("flower"))[:3]
    for path in photos:
        (folder / os.path.basename(path)).write_bytes(inputs[path])
    (folder / "bomb.jpg").write_bytes(flat_jpeg(7000))
    bomb = str(folder / "bomb.jpg")
    job = ["--model_dir", model_dir, "--input", str(folder / "*"), "--batch_size", "4", *IN_MEMORY]
    summary = run_job(capsys, *job, "--output_dir", str(tmp_path / "default"))
    assert (summary["results"], summary["errors"], summary["complete"]) == (3, 1, True)
    results, errors = read_output(str(tmp_path / "default"))
    assert sorted(os.path.basename(row["key"]) for row in results) == [os.path.basename(p) for p in photos]
    assert errors == [{"key": bomb, "error": {"status": "INVALID_ARGUMENT", "message": (
        "Image too large: 49000000 pixels exceeds the limit of 40000000 (--max_image_pixels)")}}]
    summary = run_job(capsys, *job, "--output_dir", str(tmp_path / "low"), "--max_image_pixels", "100")
    assert (summary["results"], summary["errors"]) == (0, 4)
    assert all(row["error"]["message"].endswith("exceeds the limit of 100 (--max_image_pixels)")
               for row in read_output(str(tmp_path / "low"))[1])
    with pytest.raises(SystemExit):
        batch_job.parse_args([*job, "--output_dir", str(tmp_path / "zero"), "--max_image_pixels", "0"])
    assert "--max_image_pixels must be at least 1" in capsys.readouterr().err


def _group(pgid: int, mapping: str = "") -> list[str]:
    """The command lines of the processes in a process group (with `mapping`, of those that have a file whose path
    holds it mapped: a library they have loaded)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            if mapping:
                with open(f"/proc/{pid}/maps") as f:
                    if mapping not in f.read():
                        continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.parametrize("mode", ["in_memory", "multi_processing"])
def test_ctrl_c_is_one_line_exit_130_and_leaves_no_worker(mode, model_dir, inputs, tmp_path):
    """Ctrl-C reaches the job and its Beam worker processes alike (a terminal signals the whole process group). It
    was a screenful of tracebacks: the job's, its threads' and each worker's, then forwarded again as CRITICAL log
    lines. Now one line, exit status 130, and no process of the job left."""
    listing = tmp_path / "photos.txt"
    listing.write_text((next(p for p in inputs if os.path.basename(p).startswith("flower")) + "\n") * 100_000)
    output = tmp_path / "out"
    workers = ["--direct_num_workers", "2"] if mode == "multi_processing" else []
    job = subprocess.Popen(
        [sys.executable, "-m", "petal", "batch", "--model_dir", model_dir, "--input", str(listing), "--output_dir",
         str(output), "--direct_running_mode", mode, *workers], cwd=ROOT, env=user_environment(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored, as in a background CI shell
    try:
        deadline = time.monotonic() + 120
        # running: the workers are up and past their imports (each a Python under a shell, TensorFlow loaded: a
        # Ctrl-C in the middle of a worker's import of Beam is printed by it as it dies before the job, on a loaded
        # machine not yet scheduled, has taken the signal), or the job has made its output folder
        while not (sum("sdk_worker_main" in c for c in _group(job.pid, "libtensorflow_framework")) >= 2 if workers
                   else output.exists()):
            assert job.poll() is None and time.monotonic() < deadline, "the job never got going"
            time.sleep(0.05)
        time.sleep(1.5)
        os.killpg(job.pid, signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 130, stderr[-3000:]
        assert stderr.splitlines() == [
            f"petal batch: interrupted: --output_dir {output} holds an unfinished run; rerun with --overwrite"], stderr
        while _group(job.pid):
            assert time.monotonic() < deadline, _group(job.pid)
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def test_the_spark_only_flags_are_the_spark_jobs_own():
    spark_flags = {option for action in spark_job.build_parser()._actions for option in action.option_strings}
    beam_flags = {option for action in batch_job.build_parser()._actions for option in action.option_strings}
    assert set(SPARK_ONLY_FLAGS) == spark_flags - beam_flags


def test_a_job_that_cannot_start_exits_2_in_seconds_with_one_line(model_dir, inputs, tmp_path, capfd):
    images = os.path.join(os.path.dirname(next(iter(inputs))), "*")
    jobs = failing_jobs(tmp_path, model_dir, images)
    assert_each_fails_fast_in_one_line(jobs, capfd)
    assert not (tmp_path / "out").exists()
    # and as a process of its own, the way a user meets it: the model that failed only in the workers before
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "petal", "batch", *jobs["cannot load"]], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and time.monotonic() - started < FAIL_FAST_S, done.stderr[-3000:]
    assert_one_error_line("cannot load", done.stdout, done.stderr)


def test_a_model_on_this_machine_is_refused_for_workers_elsewhere(model_dir, inputs, tmp_path):
    args, options = batch_job.parse_args(["--model_dir", model_dir, "--input", "x", "--output_dir", "o",
                                          "--runner", "DataflowRunner", "--project", "p"])
    with pytest.raises(preflight.CannotStart, match="gs://.*hdfs://.*file:///"):
        batch_job.run(args, options)
    for local in (["--runner", "FnApiRunner"], ["--runner", "PortableRunner", "--environment_type", "LOOPBACK"]):
        batch_job.check_workers_read_the_model(model_dir, batch_job.parse_args(
            ["--model_dir", model_dir, "--input", "x", "--output_dir", "o", *local])[1])
    batch_job.check_workers_read_the_model(f"file://{model_dir}", options)


FOUR_DEVICES = textwrap.dedent("""
    import json, logging, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    import petal
    from serving.batch_prediction import model_handler
    info = model_handler.read_model_info(sys.argv[1])
    try:
        model_handler.StaticBatchClassifier(info, 6)
    except ValueError as e:
        print(json.dumps({"rejected": str(e)}))
    sys.exit(petal.main(["-v", "batch", "--model_dir", sys.argv[1], "--input", sys.argv[2], "--output_dir",
                         sys.argv[3], "--batch_size", "8", "--direct_running_mode", "in_memory"]))
""")


def test_padding_on_four_logical_devices_with_batch_8_loses_and_duplicates_nothing(
        model_dir, inputs, reference, tmp_path):
    output = str(tmp_path / "out")
    pattern = os.path.join(os.path.dirname(next(iter(inputs))), "*")
    done = subprocess.run([sys.executable, "-c", FOUR_DEVICES, model_dir, pattern, output], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert "not a multiple of the 4 replicas" in lines[0]["rejected"]
    summary = lines[-1]
    assert summary["batches"] * 8 == summary["results"] + summary["padding_rows"] and summary["padding_rows"] > 0
    loaded = [json.loads(line) for line in done.stderr.splitlines() if '"model loaded"' in line]
    assert [(e["strategy"], e["replicas"]) for e in loaded] == [("MirroredStrategy", 4)]
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, inputs)
    assert_matches_reference(results, reference)


def test_multi_process_direct_runner_shares_the_model_and_loses_nothing(model_dir, inputs, reference, tmp_path):
    output = str(tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-m", "petal", "batch", "--model_dir", model_dir, "--input",
         os.path.join(os.path.dirname(next(iter(inputs))), "*"), "--output_dir", output, "--batch_size", "16",
         "--direct_running_mode", "multi_processing", "--direct_num_workers", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=user_environment(PYTHONPATH=os.pathsep.join([keras_tripwire(), ROOT])))  # workers without Keras
    assert done.returncode == 0, done.stderr[-3000:]
    # quiet by default: the worker processes' start-up lines, Beam's and TensorFlow's, are not shown (the one line
    # libjpeg prints for a corrupt input stays: an error, in the decoder's words)
    start_up = [line for line in done.stderr.splitlines() if TF_NATIVE_LOG.match(line)
                or line.startswith(("INFO:", "WARNING:root:apitools"))]
    assert start_up == [], done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["rows_in"], summary["results"], summary["errors"]) == (103, 100, 3)
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, inputs)
    assert_matches_reference(results, reference)


def test_progress_moves_with_every_batch_the_model_predicts(model_dir, inputs, tmp_path, monkeypatch, caplog):
    """Logged at every batch here (every 10 s by default), by the step that runs the model: counted where rows are
    written, which on the DirectRunner starts once the model has seen them all, a job showed none until its end."""
    monkeypatch.setattr(model_handler, "PROGRESS_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    args, options = batch_job.parse_args(["--model_dir", model_dir, "--input", os.path.join(os.path.dirname(
        next(iter(inputs))), "*"), "--output_dir", str(tmp_path / "out"), "--batch_size", "16", *IN_MEMORY])
    summary = batch_job.run(args, options)
    done = [r.fields["rows_predicted"] for r in caplog.records if r.getMessage() == "batch progress"]
    assert len(done) == summary["batches"] >= 7
    assert done == sorted(set(done)) and done[-1] == summary["results"] == 100


def test_a_worker_process_of_its_own_writes_its_progress_to_the_jobs_stderr(monkeypatch, capfd):
    """With --direct_running_mode multi_processing the model's step runs in worker processes, whose logs Beam carries
    to the job only as its own INFO lines, which a quiet job does not show: such a job showed no progress at all.
    A handler's progress, made in the job, counts a batch in a worker process."""
    monkeypatch.setattr(model_handler, "PROGRESS_SECONDS", 0.0)
    progress = model_handler.Progress()
    capfd.readouterr()
    worker = multiprocessing.get_context("fork").Process(target=progress.add, args=(16,))
    worker.start()
    worker.join(60)
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    assert [(line["logger"], line["msg"], line["rows_predicted"]) for line in lines] == [
        (PROGRESS_LOGGER, "batch progress", 16)]


def test_predictions_equal_a_real_servers_rest_predict(image_job, model_dir, inputs):
    results = {row["key"]: row["prediction"] for row in read_output(image_job[0])[0]}
    keys = sorted(results)[:12]
    body = json.dumps({"signature_name": "serving_default", "instances": [
        {"image_bytes": b64(inputs[key])} for key in keys]}).encode()
    with run_server(f"--model_base_path={model_dir}", "--model_name=flowers") as server:
        request = urllib.request.Request(f"{server.rest_url}/v1/models/flowers:predict", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            predictions = json.load(response)["predictions"]
    assert len(predictions) == len(keys)
    for key, served in zip(keys, predictions, strict=False):
        np.testing.assert_allclose(results[key]["probabilities"], served["probabilities"], atol=1e-5)
        assert (results[key]["classid"], results[key]["class"]) == (served["classid"], served["class"])


def test_the_shipped_model_classifies_fresh_flowers_as_the_server_would(tmp_path, capsys):
    labels = {}
    (tmp_path / "in").mkdir()
    for i in range(25):
        label = synth.CLASSES[i % len(synth.CLASSES)]
        path = tmp_path / "in" / f"{label}-{i}.jpg"
        path.write_bytes(synth.render(label, 90_000 + i, min_size=120, max_size=240))
        labels[str(path)] = label
    summary = run_job(capsys, "--model_dir", SHIPPED_MODEL, "--input", str(tmp_path / "in" / "*.jpg"),
                      "--output_dir", str(tmp_path / "out"), *IN_MEMORY)
    assert summary["model"].endswith("flowers/1") and summary["results"] == 25
    results, errors = read_output(str(tmp_path / "out"))
    assert not errors
    keys = sorted(labels)
    served = serving_default(SHIPPED_MODEL, [open(k, "rb").read() for k in keys])
    reference = {k: {"probabilities": served["probabilities"][i], "classid": int(served["classid"][i]),
                     "class": served["class"][i].decode()} for i, k in enumerate(keys)}
    assert_matches_reference(results, reference)
    correct = sum(row["prediction"]["class"] == labels[row["key"]] for row in results)
    assert correct >= 20, f"only {correct}/25 fresh synthetic flowers classified right"
