"""tf.Example requests in process, without a server: Classify, Regress and MultiInference warmup records replayed
on TF Serving's TF1 half_plus_two (exported_models/tf_serving_models.py), and serialized examples that count no
pixels."""
from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import classification_pb2, prediction_log_pb2, regression_pb2

from exported_models.model_format import WARMUP_FILE
from exported_models.tf_serving_models import half_plus_two
from foreign_models import example, examples_input, multi_request
from serving.core import ServingError
from serving.core.examples import CLASSIFY_METHOD, REGRESS_METHOD, serialized_examples
from serving.core.images import check_pixels
from serving.core.servable import Servable
from serving.metrics import Metrics


def write_warmup(version_dir: str, logs: list[prediction_log_pb2.PredictionLog]) -> None:
    os.makedirs(f"{version_dir}/assets.extra", exist_ok=True)
    with tf.io.TFRecordWriter(f"{version_dir}/{WARMUP_FILE}") as writer:
        for log in logs:
            writer.write(log.SerializeToString())


def warmup_logs(regress_signature: str) -> list[prediction_log_pb2.PredictionLog]:
    examples = examples_input(example(x=1.0), example(x=2.0))
    classify = classification_pb2.ClassificationRequest(input=examples)
    classify.model_spec.signature_name = "classify_x_to_y"
    regress = regression_pb2.RegressionRequest(input=examples)
    regress.model_spec.signature_name = regress_signature
    multi = multi_request(("m", REGRESS_METHOD, "regress_x_to_y"), ("m", CLASSIFY_METHOD, "classify_x_to_y"))
    return [prediction_log_pb2.PredictionLog(classify_log=prediction_log_pb2.ClassifyLog(request=classify)),
            prediction_log_pb2.PredictionLog(regress_log=prediction_log_pb2.RegressLog(request=regress)),
            prediction_log_pb2.PredictionLog(
                multi_inference_log=prediction_log_pb2.MultiInferenceLog(request=multi))]


def test_classify_regress_and_multi_inference_warmup_records_are_replayed(tmp_path):
    version_dir = half_plus_two(str(tmp_path / "m" / "1"))
    write_warmup(version_dir, warmup_logs("regress_x_to_y2"))
    metrics = Metrics()
    assert Servable("m", 1, version_dir).warmup(metrics) == 3
    write_warmup(version_dir, warmup_logs("serving_default"))  # a predict signature: no regression signature
    with pytest.raises(ServingError, match=r"^No regression inputs found in SignatureDef: "):
        Servable("m", 1, version_dir).warmup(metrics)
    write_warmup(version_dir, [prediction_log_pb2.PredictionLog(session_run_log=prediction_log_pb2.SessionRunLog())])
    with pytest.raises(ValueError, match=r"^Unsupported log_type for warmup: session_run_log$"):
        Servable("m", 1, version_dir).warmup(metrics)
    # TF Serving's warmup metrics (saved_model_warmup_util.cc), per folder and absl status: the records read before
    # the warmup ended (the failed Regress was the second record) and one latency per warmup.
    read = {sample.labels["status"].split(": ", 1)[0]: (sample.labels, sample.value)
            for family in metrics.registry.collect() if family.name == ":tensorflow:serving:model_warmup_records_read"
            for sample in family.samples if sample.name.endswith("_total")}
    assert {code: value for code, (_, value) in read.items()} == {"OK": 3, "INVALID_ARGUMENT": 1, "UNKNOWN": 0}
    assert {labels["model_path"] for labels, _ in read.values()} == {version_dir}
    assert read["INVALID_ARGUMENT"][0]["status"].startswith(
        "INVALID_ARGUMENT: No regression inputs found in SignatureDef: ")
    assert read["UNKNOWN"][0]["status"] == "UNKNOWN: Failed to load: ValueError: Unsupported log_type for warmup: " \
        "session_run_log"
    assert metrics.warmup_latency.count(model_path=version_dir, status="OK") == 1



def test_serialized_examples_and_text_count_no_pixels():
    """The pixel budget is for images: tf.Examples and text that merely start like a BMP count 0."""
    values = np.concatenate([serialized_examples(examples_input(example(x=1.0), example(image=b"\x89PNG"))),
                             np.array([b"BMW and other text, long enough", b"RIFF....WEBP but no image"], object)])
    assert check_pixels(values, 1).tolist() == [0, 0, 0, 0]
