"""What the batch jobs' tests share, whichever engine runs the job (tests/e2e/test_batch_prediction_beam.py,
test_batch_prediction_spark.py, test_batch_prediction_any_model.py): input files written with known keys, the
job's output read back, the checks that no record is lost or doubled, the failures the driver must catch in one
line, and the Keras tripwire on the workers' path.
"""
from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import tensorflow as tf

from server_harness import ROOT, TF_NATIVE_LOG
from serving.batch_prediction import cli
from serving.batch_prediction import job as batch_job


def read_output(output_dir: str) -> tuple[list[dict], list[dict]]:
    results = [json.loads(line) for path in sorted(glob.glob(f"{output_dir}/prediction.results-*"))
               for line in open(path)]
    errors = [json.loads(line) for line in open(f"{output_dir}/prediction.errors_stats-00000-of-00001")]
    return results, errors


def run_job(capsys, *argv: str) -> dict:
    """Runs `petal batch` in this process (the in-memory DirectRunner) and returns its printed summary."""
    assert batch_job.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def assert_nothing_lost(results: list[dict], errors: list[dict], expected_keys) -> None:
    keys = [row["key"] for row in results + errors]
    assert len(keys) == len(set(keys)), "a key was written twice"
    assert set(keys) == set(expected_keys)


def write_tfrecord_input(path: str, inputs: dict[str, bytes], paths: list[str]) -> list[str]:
    """Writes Examples the way training/tfrecords.py does, plus two that test keying; returns expected keys."""
    keys = []
    with tf.io.TFRecordWriter(path) as writer:
        for index, source in enumerate(paths):
            feature = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[inputs[source]]))}
            if index:
                feature["image/filename"] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[source.encode()]))
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
            keys.append(source if index else f"{path}:0")
        writer.write(tf.train.Example().SerializeToString())
        keys.append(f"{path}:{len(paths)}")
    return keys


# TFRecord framing: an 8-byte length and its 4-byte CRC, the data, the data's 4-byte CRC.
TFRECORD_HEADER, TFRECORD_FRAMING = 12, 16


def write_cut_tfrecords(folder, inputs: dict[str, bytes], paths: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """Three TFRecord files of three images each (keyed by their path): one whole, and two whose last record is
    cut, one inside its 12-byte header (TensorFlow's reader stops there without a word), one inside its data.
    Returns the pattern, every key the job must write (a cut tail is keyed by its record's position), and, by key,
    the byte offset its error must name."""
    keys, cuts = [], {}
    for number, (name, keep) in enumerate((("whole", None), ("header-cut", 5), ("body-cut", TFRECORD_HEADER + 9))):
        path = str(folder / f"{name}.tfrecord")
        sources = paths[3 * number:3 * number + 3]
        records = [tf.train.Example(features=tf.train.Features(feature={
            "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[inputs[source]])),
            "image/filename": tf.train.Feature(bytes_list=tf.train.BytesList(value=[source.encode()]))}))
            .SerializeToString() for source in sources]
        with tf.io.TFRecordWriter(path) as writer:
            for record in records:
                writer.write(record)
        if keep is None:
            keys += sources
            continue
        whole = sum(len(r) + TFRECORD_FRAMING for r in records[:-1])
        with open(path, "r+b") as f:
            f.truncate(whole + keep)
        keys += sources[:-1] + [f"{path}:2"]
        cuts[f"{path}:2"] = f"byte {whole} of {whole + keep}"
    return str(folder / "*.tfrecord"), keys, cuts


def assert_cut_tails_are_one_error_each(errors: list[dict], cuts: dict[str, str]) -> None:
    lost = {row["key"]: row["error"] for row in errors if row["key"] in cuts}
    assert sorted(lost) == sorted(cuts)
    for key, error in lost.items():
        assert error["status"] == "DATA_LOSS" and cuts[key] in error["message"], error
        assert key.rsplit(":", 1)[0] in error["message"]


def write_jsonl_input(path: str, inputs: dict[str, bytes], paths: list[str]) -> list[str]:
    lines = [json.dumps({"key": source, "image_bytes": {"b64": base64.b64encode(inputs[source]).decode()}})
             for source in paths]
    lines += ["{not json", json.dumps({"key": "bad-b64", "image_bytes": {"b64": "@@@"}}),
              '{"key": NaN, "image_bytes": {"b64": "QQ=="}}', json.dumps({"key": None, "image_bytes": {"b64": "@@@"}})]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return paths + [f"{path}:{len(paths) + 1}", "bad-b64", f"{path}:{len(paths) + 3}", f"{path}:{len(paths) + 4}"]




FAIL_FAST_S = 30


def keras_tripwire() -> str:
    """A folder holding a `keras` package that fails loudly when imported: first on a batch worker's path, it turns
    any Keras import there into a failed task, so every job a test runs also proves that its workers stay
    without Keras (docs/batch.md, 'Lean workers')."""
    folder = os.path.join(tempfile.gettempdir(), f"petal-keras-tripwire-{os.getuid()}")
    os.makedirs(os.path.join(folder, "keras"), exist_ok=True)
    with open(os.path.join(folder, "keras", "__init__.py"), "w") as f:
        f.write('raise RuntimeError("keras was imported in a batch worker")\n')
    return folder


def unloadable_models(folder, model_dir: str) -> dict[str, str]:
    """Two models no worker could load: one without its variables, one whose saved_model.pb is not a SavedModel."""
    without_variables, not_a_model = folder / "without-variables", folder / "not-a-model" / "1"
    shutil.copytree(model_dir, without_variables)
    shutil.rmtree(without_variables / "1" / "variables")
    not_a_model.mkdir(parents=True)
    (not_a_model / "saved_model.pb").write_bytes(b"this is not a SavedModel")
    return {"cannot load": str(without_variables), "cannot read the SavedModel": str(not_a_model.parent)}


def failing_jobs(folder, model_dir: str, images: str, *extra: str) -> dict[str, list[str]]:
    """A `petal batch` argv for each failure the driver must catch, by the words its one line must hold: an
    unreadable model (two kinds), an input pattern that matches nothing or only a folder, an output folder that
    cannot be written (under a regular file, which stops root too)."""
    (folder / "a-file").write_text("not a folder\n")
    jobs = {words: ["--model_dir", bad, "--input", images, "--output_dir", str(folder / "out")]
            for words, bad in unloadable_models(folder, model_dir).items()}
    jobs["matches no files"] = ["--model_dir", model_dir, "--input", str(folder / "nothing-*.jpg"), "--output_dir",
                                str(folder / "out")]
    jobs[f"--input {folder} matches no files"] = ["--model_dir", model_dir, "--input", str(folder), "--output_dir",
                                                  str(folder / "out")]  # a folder is not an image, even named alone
    jobs["cannot be written"] = ["--model_dir", model_dir, "--input", images, "--output_dir",
                                 str(folder / "a-file" / "out")]
    return {words: [*argv, *extra] for words, argv in jobs.items()}


def assert_one_error_line(words: str, out: str, err: str) -> None:
    """Nothing on stdout, and one line on stderr that holds `words` (TensorFlow's native start-up lines aside):
    no traceback, from Python, Spark or Beam."""
    lines = [line for line in err.splitlines() if line.strip() and not TF_NATIVE_LOG.match(line)]
    assert out == "" and len(lines) == 1, (words, out, err[-3000:])
    assert lines[0].startswith("petal batch: error: ") and words in lines[0], (words, lines[0])


def assert_each_fails_fast_in_one_line(jobs: dict[str, list[str]], capfd) -> None:
    """Runs each job through `petal batch`'s engine choice in this process (a TensorFlow start-up each would cost
    seconds of CPU): each must return exit status 2 within FAIL_FAST_S, in one line on the terminal."""
    capfd.readouterr()
    for words, argv in jobs.items():
        started = time.monotonic()
        assert cli.main(argv) == 2, words
        seconds = time.monotonic() - started
        assert_one_error_line(words, *capfd.readouterr())
        assert seconds < FAIL_FAST_S, f"{words}: {seconds:.0f} s"


def spark_env() -> dict[str, str]:
    """Loopback only, this Python (with Petal from this checkout, behind the Keras tripwire) for the Python
    workers, TF's C++ logs off."""
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join(filter(None, [keras_tripwire(), ROOT, os.environ.get("PYTHONPATH")])),
            "TF_CPP_MIN_LOG_LEVEL": "3"}
