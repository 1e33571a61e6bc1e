"""`petal predict` without a server: the real console script (and its main() for the cheaper cases) on real
JPEG files and a real SavedModel."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from exported_models.model_format import DEFAULT_MODEL_BASE_PATH
from server_harness import tiny_model_base
from serving.client import cli as predict_cli
from training.synth import CLASSES, render

PETAL = os.path.join(os.path.dirname(sys.executable), "petal")


@pytest.fixture(scope="module")
def model_base() -> str:
    return tiny_model_base()


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, label in enumerate(CLASSES[:3]):
        path = folder / f"{label}.jpg"
        path.write_bytes(render(label, seed=20 + i, size=(50, 36)))
        paths.append(str(path))
    return paths


def petal_predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PETAL, "predict", *args], capture_output=True, text=True, timeout=120)


def test_json_matches_the_signature(model_base, image_files):
    result = petal_predict(*image_files, "--model_base_path", model_base, "--top_k", "2", "--format", "json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    signature = tf.saved_model.load(f"{model_base}/1").signatures["serving_default"]
    expected = signature(image_bytes=tf.constant([open(p, "rb").read() for p in image_files]))["probabilities"]
    assert [line["image"] for line in lines] == image_files
    for line, probabilities in zip(lines, expected.numpy(), strict=False):
        best = np.argsort(-probabilities)[:2]
        assert [p["label"] for p in line["predictions"]] == [CLASSES[i] for i in best]
        np.testing.assert_allclose([p["score"] for p in line["predictions"]], probabilities[best], rtol=1e-5)


def test_table_and_bad_image(model_base, image_files, tmp_path, capsys):
    bad = tmp_path / "notes.jpg"
    bad.write_bytes(b"this is text, not a JPEG")
    assert predict_cli.main([image_files[0], str(bad), "--model_base_path", model_base, "--top_k", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["IMAGE", "RANK", "LABEL", "SCORE"]
    ranks = [line.split()[1] for line in lines[1:] if line.startswith(image_files[0])]
    assert ranks == ["1", "2", "3"]
    [error_line] = [line for line in lines if line.startswith(str(bad))]
    assert "INVALID_ARGUMENT" in error_line and "image file format" in error_line


def test_default_model_is_found_from_any_working_directory(image_files, tmp_path):
    assert os.path.isabs(DEFAULT_MODEL_BASE_PATH)
    result = subprocess.run([PETAL, "predict", image_files[0], "--top_k", "1", "--format", "json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [prediction] = json.loads(result.stdout)["predictions"]
    assert prediction["label"] in CLASSES and 0 < prediction["score"] <= 1


def test_clear_errors_for_missing_model_and_file(tmp_path, image_files, capsys):
    assert predict_cli.main([image_files[0], "--model_base_path", str(tmp_path / "none")]) == 1
    assert "no SavedModel" in capsys.readouterr().err
    assert predict_cli.main([str(tmp_path / "missing.jpg")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        predict_cli.main([image_files[0], "--grpc"])
    assert info.value.code == 2 and "--grpc needs --server" in capsys.readouterr().err
