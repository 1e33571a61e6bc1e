"""`petal export` and `petal batch` on an object store: moto's S3 server on 127.0.0.1 (tests/object_stores.py), with
IAM keys required, holds the model, the photos and the predictions.

The commands are docs/batch.md's own ('Object stores'), read from it and run as a user types them, in a folder of
their own (the virtualenv linked there, a checkpoint in `runs/flowers`): `petal export` uploads the next version
beside the one there; the Beam job and the Spark job (on the Spark tests' standalone cluster, tests/spark_cluster.py,
whose executors run in their workers' folders and get the store's variables from `spark.executorEnv.*` only) read
that version and nine photos, one a corrupt JPEG, from the store and write one result or one error per photo back
to it, with the answers of the model's own serving signature. Every input format reads from the store as from a
disk, and a store the job cannot use (its package missing, a wrong key, no such bucket) stops it in one line, exit
status 2.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from batch_jobs import (
    assert_each_fails_fast_in_one_line,
    keras_tripwire,
    spark_env,
    write_cut_tfrecords,
    write_jsonl_input,
    write_tfrecord_input,
)
from exported_models import storage
from object_stores import MotoS3, client_environment, s3_store_fixture  # noqa: F401 (the s3_store fixture)
from server_harness import IMAGE_SIZE, LABELS, ROOT, tiny_model_base
from serving.batch_prediction import steps
from spark_cluster import Cluster
from training import synth
from training.models import ModelConfig

BUCKET = "petal-demo"
MODEL = f"s3://{BUCKET}/models/flowers"
CORRUPT = "corrupt.jpg"
GOOD = 8
RUN_S = 300


def documented_commands() -> dict[str, str]:
    """The commands of docs/batch.md's tested block ('Object stores'), each on one line, by what they run."""
    section = (Path(ROOT) / "docs" / "batch.md").read_text().split("\n## Object stores\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [" ".join(line.split()) for line in block.splitlines()
                if line.strip() and not line.startswith(("#", "export "))]
    return {"export" if "petal export" in c else "spark" if "--engine=spark" in c else "beam": c for c in commands}


def run(command: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A documented command run by the shell in `folder`, as typed there."""
    done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=RUN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def photos() -> dict[str, bytes]:
    jpeg = synth.render("daisy", 0, min_size=40, max_size=64)
    files = {f"flower{i}.jpg": synth.render(i % 5, i, min_size=40, max_size=64) for i in range(GOOD)}
    files[CORRUPT] = jpeg[:20] + bytes(len(jpeg) - 20)
    return files


@pytest.fixture(scope="module")
def store(s3_store: MotoS3) -> MotoS3:
    """The bucket, signed requests only, the tiny model as version 1 and the photos."""
    s3_store.require_credentials()
    s3_store.create_bucket(BUCKET)
    s3_store.upload_tree(os.path.join(tiny_model_base(), "1"), f"{MODEL}/1")
    for name, data in photos().items():
        s3_store.put(f"s3://{BUCKET}/photos/{name}", data)
    return s3_store


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Where the user types the commands: the virtualenv (this one, linked) and a run's checkpoint in runs/flowers."""
    home = tmp_path_factory.mktemp("user")
    (home / ".venv").symlink_to(Path(sys.executable).parent.parent)
    run_dir = home / "runs" / "flowers"
    run_dir.mkdir(parents=True)
    config = ModelConfig("compact", tuple(LABELS), IMAGE_SIZE)
    config.save(str(run_dir))
    tf.train.Checkpoint(model=config.build()).save(str(run_dir / "ckpt"))
    return home


@pytest.fixture(scope="module")
def exported(store, folder, tmp_path_factory) -> tuple[str, str]:
    """`petal export` to the store, as documented: what it printed, and a local copy of the version it uploaded."""
    done = run(documented_commands()["export"], folder, client_environment(store.env))
    copy = tmp_path_factory.mktemp("exported")
    client = store.client()
    for key in store.keys(f"{MODEL}/2/"):
        target = copy / key.removeprefix("models/flowers/2/")
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(BUCKET, key, str(target))
    return done.stdout.strip(), str(copy)


@pytest.fixture(scope="module")
def reference(exported) -> dict[str, dict]:
    """The uploaded version's serving_default answer for each good photo, by its URL."""
    good = {name: data for name, data in photos().items() if name != CORRUPT}
    outputs = tf.saved_model.load(exported[1]).signatures["serving_default"](image_bytes=tf.constant(list(
        good.values())))
    return {f"s3://{BUCKET}/photos/{name}": {"probabilities": outputs["probabilities"][i].numpy(),
                                             "classid": int(outputs["classid"][i])} for i, name in enumerate(good)}


def test_petal_export_uploads_the_next_version_whole(store, exported):
    printed, copy = exported
    assert printed == f"{MODEL}/2"
    uploaded = {key.removeprefix("models/flowers/") for key in store.keys(f"{MODEL}/")}
    assert {"1/saved_model.pb", "2/saved_model.pb", "2/variables/variables.index", "2/assets/labels.txt",
            "2/assets.extra/tf_serving_warmup_requests"} <= uploaded
    assert not [key for key in uploaded if not key.startswith(("1/", "2/"))], uploaded  # no staging left behind
    assert storage.list_files(copy).keys() == {key.removeprefix("2/") for key in uploaded if key.startswith("2/")}
    assert (Path(copy) / "assets" / "labels.txt").read_text().split() == LABELS


def read_predictions(store: MotoS3, output: str) -> tuple[list[str], list[dict], list[dict]]:
    """The output folder's objects, and its results and errors lines, read with boto3."""
    client = store.client()
    names = sorted(key.removeprefix(output.removeprefix(f"s3://{BUCKET}/")) for key in store.keys(f"{output}/"))
    lines = {name: client.get_object(Bucket=BUCKET, Key=output.removeprefix(f"s3://{BUCKET}/") + name)["Body"]
             .read().decode().splitlines() for name in names}
    results = [json.loads(line) for name in names if name.startswith("/prediction.results-") for line in lines[name]]
    errors = [json.loads(line) for line in lines["/prediction.errors_stats-00000-of-00001"]]
    return names, results, errors


def assert_every_photo_once(store: MotoS3, stdout: str, output: str, reference: dict[str, dict]) -> list[str]:
    """Rows in = results + errors = the nine photos, the corrupt one an error row, the others the model's own
    answers; returns the output folder's object names."""
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert (summary["model"], summary["output_dir"]) == (f"{MODEL}/2", output)
    assert (summary["rows_in"], summary["results"], summary["errors"], summary["complete"]) == (GOOD + 1, GOOD, 1,
                                                                                               True)
    names, results, errors = read_predictions(store, output)
    assert [(row["key"], row["error"]["status"]) for row in errors] == [(f"s3://{BUCKET}/photos/{CORRUPT}",
                                                                          "INVALID_ARGUMENT")]
    assert "Invalid JPEG data" in errors[0]["error"]["message"]
    assert sorted(row["key"] for row in results) == sorted(reference)
    for row in results:
        expected = reference[row["key"]]
        np.testing.assert_allclose(row["prediction"]["probabilities"], expected["probabilities"], atol=1e-5)
        assert row["prediction"]["classid"] == expected["classid"]
    assert not [name for name in names if not name.startswith("/prediction.")], names  # no parts, no write check
    return names


def test_a_beam_job_reads_its_model_and_photos_from_s3_and_writes_every_row_there(store, folder, exported,
                                                                                  reference):
    tripwire = {"PYTHONPATH": os.pathsep.join([keras_tripwire(), ROOT])}  # it imports no Keras
    done = run(documented_commands()["beam"], folder, client_environment(store.env, tripwire))
    assert_every_photo_once(store, done.stdout, f"s3://{BUCKET}/predictions/beam", reference)


def variables(pid: int) -> list[str]:
    """The names in a process's environment."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return [entry.split(b"=", 1)[0].decode() for entry in f.read().split(b"\0") if entry]


def model_copies(cluster: Cluster) -> list[int]:
    """How many copies of the model the executors downloaded into their application folders, on each worker."""
    return [len(glob.glob(os.path.join(work_dir, "*", "*", "petal-model-*", "flowers", "2", "saved_model.pb")))
            for work_dir in cluster.work_dirs]


def test_a_spark_job_on_the_cluster_reads_and_writes_s3_with_the_executor_environment_it_was_given(
        store, folder, exported, reference, spark_cluster):
    """The cluster's workers were started without the store's variables: the executors have them only from the
    job's spark.executorEnv settings, and download the model themselves, into their own folders."""
    assert not [name for pid in spark_cluster.worker_pids for name in variables(pid) if name in store.env]
    command = documented_commands()["spark"].replace("spark://HOST:7077", spark_cluster.url)
    done = run(command, folder, client_environment(spark_env(), store.env))
    names = assert_every_photo_once(store, done.stdout, f"s3://{BUCKET}/predictions/spark", reference)
    assert len(names) == json.loads(done.stdout.splitlines()[-1])["partitions"] + 1 == 4
    assert model_copies(spark_cluster) == [1, 1]  # by each worker's executor, whose one Python worker ran its tasks


@pytest.fixture
def environment(store, monkeypatch):
    """The store's variables in this process, whose file systems are made from them; a test may set others."""
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


@pytest.mark.parametrize("engine", ["beam", "spark"])
def test_a_store_the_job_cannot_use_is_one_line_and_exit_2(engine, environment, capfd):
    """No such bucket (for the model, for the output), a wrong key, s3fs not installed: before Spark starts or Beam
    builds a pipeline."""
    def job(model: str = MODEL, output: str = f"s3://{BUCKET}/predictions/never") -> list[str]:
        spark = ["--spark_master", "local[1]"] if engine == "spark" else []
        return ["--engine", engine, "--model_dir", model, "--input", f"s3://{BUCKET}/photos/*.jpg", "--output_dir",
                output, *spark]

    nowhere = "s3://no-such-bucket/models/flowers"
    assert_each_fails_fast_in_one_line({  # the reason is the storage layer's words
        f"--model_dir {nowhere}: could not list {nowhere}: ": job(model=nowhere),
        "--output_dir s3://no-such-bucket/out: could not list s3://no-such-bucket/out: ": job(
            output="s3://no-such-bucket/out")}, capfd)
    environment.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")  # a file system made with it
    assert_each_fails_fast_in_one_line({f"--model_dir {MODEL}: could not list {MODEL}: ": job()}, capfd)
    environment.setitem(sys.modules, "s3fs", None)
    assert_each_fails_fast_in_one_line({
        f"--model_dir {MODEL}: s3:// needs s3fs, which a plain install leaves out: pip install 'petal[s3]'": job()},
        capfd)


def test_each_input_kind_reads_the_same_from_the_store_as_from_a_disk(store, environment, tmp_path):
    """TFRecords (whole, and cut inside a record's header and inside its data), JSON Lines (plain and gzipped, bad
    lines among them) and a file list (relative lines): each file's records and failures, read from the store,
    are those of the same file read from a disk, under its URL."""
    disk, url = tmp_path / "inputs", f"s3://{BUCKET}/inputs"
    disk.mkdir()
    images = {str(disk / name): data for name, data in photos().items()}
    for path, data in images.items():
        Path(path).write_bytes(data)
    paths = sorted(images)
    write_tfrecord_input(str(disk / "a.tfrecord"), images, paths[:3])
    write_cut_tfrecords(disk, images, paths)
    write_jsonl_input(str(disk / "a.jsonl"), images, paths[:3])
    (disk / "b.jsonl.gz").write_bytes(gzip.compress((disk / "a.jsonl").read_bytes()))
    (disk / "list.txt").write_text("flower1.jpg\n\n/elsewhere/x.jpg\ns3://other/y.jpg\n")
    store.upload_tree(disk, url)

    def on_the_store(item: object) -> str:
        """An item with the disk's folder named as the store's (in keys of positions, and in the records' keys)."""
        return repr(item).replace(str(disk), url)

    readers = {".tfrecord": steps.read_tfrecord_file, ".jsonl": steps.read_jsonl_file, ".gz": steps.read_jsonl_file,
               ".txt": steps.read_file_list}
    files = [path for path in sorted(os.listdir(disk)) if os.path.splitext(path)[1] in readers]
    assert len(files) == 7
    for name in files:
        read = readers[os.path.splitext(name)[1]]
        from_store = [on_the_store(item) for item in read(f"{url}/{name}")]
        assert from_store == [on_the_store(item) for item in read(str(disk / name))], name
    assert list(steps.read_file_list(f"{url}/list.txt")) == [f"{url}/flower1.jpg", "/elsewhere/x.jpg",
                                                              "s3://other/y.jpg"]
    assert steps.read_file(f"{url}/flower1.jpg") == (f"{url}/flower1.jpg", images[str(disk / "flower1.jpg")])
