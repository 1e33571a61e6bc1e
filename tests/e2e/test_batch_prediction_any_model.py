"""`petal batch` on SavedModels exported elsewhere: Predict on JSON lines, Classify and Regress on tf.Examples.

The models are TF Serving's TF1 half_plus_two graph (exported_models/tf_serving_models.py: y = 0.5 x + 2) and
tests/foreign_models.py's TF2 tf.Module. Each job mixes
corrupt records into good ones and checks that every record comes out once, as a result or an error, and that the
answers are the ones a real `petal serve` gives over REST for the same records. Beam runs on the in-process
DirectRunner; Spark on `local[1]`.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
import requests
import tensorflow as tf

from batch_jobs import read_output, run_job, spark_env
from exported_models.tf_serving_models import half_plus_two
from foreign_models import example, tf2_module
from server_harness import ROOT, run_server
from serving.batch_prediction import job as batch_job

BATCH = 4
XS = [float(x) for x in (1, 2, 3, 5, 8, 10, -4, 0.5, 2.25)]  # 9 good rows: two full batches and a padded one


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("foreign-batch")
    half_plus_two(str(root / "tf1" / "00000123"))
    tf2_module(str(root / "tf2"))
    return {"tf1": str(root / "tf1"), "tf2": str(root / "tf2")}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "models.config"
    config.write_text("model_config_list { "
                      f'config {{ name: "tf1" base_path: "{models["tf1"]}" model_platform: "tensorflow" }} '
                      f'config {{ name: "tf2" base_path: "{models["tf2"]}" model_platform: "tensorflow" }} }}')
    with run_server(f"--model_config_file={config}") as srv:
        yield srv


def rest(server, model: str, verb: str, body: dict) -> dict:
    response = requests.post(f"{server.rest_url}/v1/models/{model}:{verb}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def write_jsonl(path, lines: list) -> str:
    with open(path, "w") as f:
        f.writelines((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return str(path)


def write_tfrecord(path, records: list[bytes]) -> str:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return str(path)


def keyed_example(key: str, **features) -> bytes:
    proto = example(**features)
    proto.features.feature["key"].bytes_list.value.append(key.encode())
    return proto.SerializeToString()


def by_key(rows: list[dict]) -> dict:
    keys = [row["key"] for row in rows]
    assert len(keys) == len(set(keys)), keys
    return {row["key"]: row for row in rows}


def beam(capsys, model: str, pattern: str, output, *extra: str) -> tuple[dict, dict, dict]:
    summary = run_job(capsys, "--model_dir", model, "--input", pattern, "--output_dir", str(output),
                      "--batch_size", str(BATCH), "--runner", "DirectRunner", "--direct_running_mode", "in_memory",
                      *extra)
    results, errors = read_output(str(output))
    assert summary["complete"] and summary["rows_in"] == len(results) + len(errors), summary
    assert summary["results"] == len(results) and summary["errors"] == len(errors)
    return summary, by_key(results), by_key(errors)


def assert_errors(errors: dict, expected: dict[str, str]) -> None:
    assert set(errors) == set(expected)
    for key, text in expected.items():
        assert errors[key]["error"]["status"] == "INVALID_ARGUMENT" and text in errors[key]["error"]["message"], \
            errors[key]


def test_tf1_predict_on_json_lines_answers_as_rest_predict(models, server, tmp_path, capsys):
    good = [{"key": f"x{i}", "instance": {"x": [x]}} for i, x in enumerate(XS)]
    bad = ["{not json", {"key": "no-instance", "instances": [{"x": [1.0]}]},
           {"key": "text", "instance": {"x": ["one"]}}, {"key": "other-input", "instance": {"z": [1.0]}}]
    pattern = write_jsonl(tmp_path / "rows.jsonl", good[:5] + bad + good[5:])
    summary, results, errors = beam(capsys, models["tf1"], pattern, tmp_path / "out")
    expected = rest(server, "tf1", "predict", {"instances": [row["instance"] for row in good]})["predictions"]
    assert {key: row["prediction"] for key, row in results.items()} == {
        row["key"]: answer for row, answer in zip(good, expected, strict=False)}
    assert [results[f"x{i}"]["prediction"] for i in range(3)] == [[2.5], [3.0], [3.5]]  # half_plus_two
    assert_errors(errors, {f"{pattern}:6": "not valid JSON", "no-instance": '"instance"',
                           "text": "expects DT_FLOAT", "other-input": "the signature takes ['x']"})
    assert summary["rows_in"] == 13 and summary["padding_rows"] == 3 * BATCH - len(good)


def tf1_example_records() -> tuple[list[bytes], list[dict]]:
    """Good tf.Examples keyed by their `key` feature, a record that is no tf.Example and one the model cannot
    parse (no `x`), mixed in; and the good ones as REST examples."""
    good = [keyed_example(f"e{i}", x=x) for i, x in enumerate(XS)]
    bad = [b"\xff\x00 not a proto", keyed_example("no-x", x2=1.0)]
    return good[:4] + bad + good[4:], [{"x": x} for x in XS]


def test_tf1_classify_on_tfrecords_answers_as_rest_classify(models, server, tmp_path, capsys):
    records, rest_examples = tf1_example_records()
    pattern = write_tfrecord(tmp_path / "examples.tfrecord", records)
    summary, results, errors = beam(capsys, models["tf1"], pattern, tmp_path / "out",
                                    "--signature_name", "classify_x_to_y")
    expected = rest(server, "tf1", "classify", {"signature_name": "classify_x_to_y",
                                                "examples": rest_examples})["results"]
    assert {key: row["result"] for key, row in results.items()} == {f"e{i}": r for i, r in enumerate(expected)}
    assert results["e0"]["result"] == [["", 2.5]]  # scores only: no class names
    assert set(errors) == {f"{pattern}:4", "no-x"}
    assert "not a serialized tf.train.Example" in errors[f"{pattern}:4"]["error"]["message"]
    assert errors["no-x"]["error"]["status"] == "INVALID_ARGUMENT" and "x" in errors["no-x"]["error"]["message"]
    assert summary["rows_in"] == len(records)


def test_tf1_regress_on_json_examples_answers_as_rest_regress(models, server, tmp_path, capsys):
    good = [{"key": f"r{i}", "example": {"x": x}} for i, x in enumerate(XS)]
    bad = [{"key": "not-object", "example": 5}, {"key": "no-example", "instance": {"x": 1.0}},
           {"key": "text-x", "example": {"x": "one"}}, {"key": "b64-x", "example": {"x": {"b64": "AAE="}}}]
    pattern = write_jsonl(tmp_path / "examples.jsonl", bad[:2] + good + bad[2:])
    summary, results, errors = beam(capsys, models["tf1"], pattern, tmp_path / "out",
                                    "--signature_name", "regress_x_to_y2", "--input_format", "jsonl")
    expected = rest(server, "tf1", "regress", {"signature_name": "regress_x_to_y2",
                                               "examples": [row["example"] for row in good]})["results"]
    assert {key: row["result"] for key, row in results.items()} == {f"r{i}": r for i, r in enumerate(expected)}
    assert [results["r0"]["result"], results["r1"]["result"]] == [3.5, 4.0]  # TF Serving's documented answer
    assert_errors(errors, {"not-object": "Example must be JSON object", "no-example": '"example"',
                           "text-x": "", "b64-x": ""})
    assert summary["rows_in"] == len(good) + len(bad)


def test_tf2_module_predicts_and_classifies_by_the_signatures_structure(models, server, tmp_path, capsys):
    rows = [{"key": f"p{i}", "instance": x} for i, x in enumerate(XS)] + [{"key": "list", "instance": [1.0, 2.0]}]
    pattern = write_jsonl(tmp_path / "rows.jsonl", rows)
    _, results, errors = beam(capsys, models["tf2"], pattern, tmp_path / "predict")
    assert {key: row["prediction"] for key, row in results.items()} == {
        f"p{i}": 0.5 * x + 2 for i, x in enumerate(XS)}
    assert set(errors) == {"list"} and errors["list"]["error"]["status"] == "INVALID_ARGUMENT"
    records, rest_examples = tf1_example_records()
    pattern = write_tfrecord(tmp_path / "examples.tfrecord", records)
    summary, results, errors = beam(capsys, models["tf2"], pattern, tmp_path / "classify",
                                    "--signature_name", "classify")  # method name "predict": chosen by structure
    expected = rest(server, "tf2", "classify", {"signature_name": "classify", "examples": rest_examples})["results"]
    assert {key: row["result"] for key, row in results.items()} == {f"e{i}": r for i, r in enumerate(expected)}
    assert set(errors) == {f"{pattern}:4", "no-x"} and summary["rows_in"] == len(records)


def test_tf2_multi_input_signature_with_strings_and_bytes(models, tmp_path, capsys):
    text = "héllo".encode()
    rows = [{"key": "a", "instance": {"ids": [1, 2], "text": "abc"}},
            {"key": "b", "instance": {"ids": [3, 4], "text": {"b64": base64.b64encode(text).decode()}}},
            {"key": "float-ids", "instance": {"ids": [1.5, 2], "text": "x"}}]
    pattern = write_jsonl(tmp_path / "rows.jsonl", rows)
    _, results, errors = beam(capsys, models["tf2"], pattern, tmp_path / "out", "--signature_name", "multi")
    assert results["a"]["prediction"] == {"sum": 3, "length": 3, "echo_bytes": {"b64": "YWJj"}}
    assert results["b"]["prediction"] == {"sum": 7, "length": len(text),
                                          "echo_bytes": {"b64": base64.b64encode(text).decode()}}
    assert "expects DT_INT64" in errors["float-ids"]["error"]["message"]


def test_spark_local_1_classifies_tfrecords_as_the_beam_job(models, tmp_path, capsys):
    records, _ = tf1_example_records()
    pattern = write_tfrecord(tmp_path / "examples.tfrecord", records)
    _, beam_results, beam_errors = beam(capsys, models["tf1"], pattern, tmp_path / "beam",
                                        "--signature_name", "classify_x_to_y")
    output = tmp_path / "spark"
    done = subprocess.run([sys.executable, "-m", "petal", "batch", "--engine=spark", "--spark_master", "local[1]",
                           "--model_dir", models["tf1"], "--input", pattern, "--output_dir", str(output),
                           "--batch_size", str(BATCH), "--signature_name", "classify_x_to_y"],
                          capture_output=True, text=True, cwd=ROOT, env=spark_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    results, errors = read_output(str(output))
    assert summary["complete"] and summary["rows_in"] == len(records) == len(results) + len(errors)
    assert by_key(results) == beam_results and by_key(errors) == beam_errors


def test_a_signature_that_cannot_read_the_input_stops_before_the_job(models, tmp_path, capsys):
    pattern = write_tfrecord(tmp_path / "examples.tfrecord", [keyed_example("a", x=1.0)])
    for extra, text in ((["--signature_name", "serving_default"], "runs predict, which reads --input_format jsonl"),
                        (["--method", "classify"], "cannot classify: No classification inputs found"),
                        (["--signature_name", "nope"], "has no 'nope' signature")):
        assert batch_job.main(["--model_dir", models["tf1"], "--input", pattern, "--output_dir",
                               str(tmp_path / "o"), *extra]) == 2
        assert text in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
