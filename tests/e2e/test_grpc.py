"""TF Serving's gRPC API against a real `petal serve` subprocess, called the way TF Serving's own example
clients call it: PredictionServiceStub / ModelServiceStub with tf.make_tensor_proto of JPEG bytes."""
from __future__ import annotations

import io
import signal
import time

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    input_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    regression_pb2,
)
from tensorflow_serving.config import model_server_config_pb2

from grpc_calls import MB, predict_request, rpc_error
from server_harness import IMAGE_SIZE, run_server, tiny_model_base
from training.synth import CLASSES, render

# A lone request waits this long for company in the batch queue: the artificial delay the deadline test needs.
BATCH_TIMEOUT_S = 0.25


@pytest.fixture(scope="module")
def model_base() -> str:
    return tiny_model_base()


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    params = tmp_path_factory.mktemp("config") / "batching.txt"
    params.write_text(f"max_batch_size {{ value: 4 }} batch_timeout_micros {{ value: {int(BATCH_TIMEOUT_S * 1e6)} }}"
                      " num_batch_threads { value: 1 } max_enqueued_batches { value: 8 }")
    with run_server(f"--model_base_path={model_base}", "--model_name=flowers", "--enable_batching",
                    f"--batching_parameters_file={params}", "--grpc_channel_arguments=grpc.max_concurrent_streams=100",
                    "--enable_model_control") as srv:
        yield srv


@pytest.fixture(scope="module")
def model_stub(channel):
    return model_service_pb2_grpc.ModelServiceStub(channel)


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [render(label, seed=7, size=(48, 40)) for label in CLASSES[:4]]


@pytest.fixture(scope="module")
def local_probabilities(model_base, images) -> np.ndarray:
    signature = tf.saved_model.load(f"{model_base}/1").signatures["serving_default"]
    return signature(image_bytes=tf.constant(images))["probabilities"].numpy()


def test_stock_client_predict_matches_in_process(stub, images, local_probabilities):
    response = stub.Predict(predict_request(jpegs=images), timeout=30)
    probabilities = tf.make_ndarray(response.outputs["probabilities"])
    classid = tf.make_ndarray(response.outputs["classid"])
    classes = tf.make_ndarray(response.outputs["class"])
    np.testing.assert_allclose(probabilities, local_probabilities, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(classid, local_probabilities.argmax(axis=1))
    assert [c.decode() for c in classes] == [CLASSES[i] for i in classid]
    assert response.model_spec.name == "flowers"
    assert response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"


def test_output_filter_version_and_signature(stub, images, local_probabilities):
    response = stub.Predict(predict_request(signature="serving_default", jpegs=images[:1], version=1),
                                    timeout=30)
    assert set(response.outputs) == {"probabilities", "classid", "class"}
    request = predict_request(jpegs=images[:2])
    request.output_filter.append("classid")
    response = stub.Predict(request, timeout=30)
    assert list(response.outputs) == ["classid"]
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["classid"]), local_probabilities[:2].argmax(1))


def test_predict_images_signature_takes_float_pixels(stub):
    pixels = np.random.default_rng(0).uniform(-1, 1, (3, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    response = stub.Predict(predict_request(signature="predict_images", images=pixels), timeout=30)
    probabilities = tf.make_ndarray(response.outputs["probabilities"])
    assert probabilities.shape == (3, len(CLASSES))
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert response.model_spec.signature_name == "predict_images"


def test_errors_map_to_tf_codes(stub, images):
    err = rpc_error(stub.Predict, predict_request("nope", jpegs=images[:1]), timeout=30)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.details()
    err = rpc_error(stub.Predict, predict_request(jpegs=images[:1], version=42), timeout=30)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(stub.Predict, predict_request(jpegs=images[:1], version_label="nolabel"), timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nolabel" in err.details()
    err = rpc_error(stub.Predict, predict_request(jpegs=[b"definitely not a jpeg"]), timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(stub.Predict, predict_request(signature="nosig", jpegs=images[:1]), timeout=30)
    assert (err.code(), err.details()) == (grpc.StatusCode.FAILED_PRECONDITION,
                                           'Serving signature key "nosig" not found.')
    missing_name = predict_pb2.PredictRequest()
    missing_name.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto(images[:1]))
    assert rpc_error(stub.Predict, missing_name, timeout=30).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_image_next_to_good_ones_is_invalid_argument_and_server_keeps_serving(stub, images):
    err = rpc_error(stub.Predict, predict_request(jpegs=[images[0], b"\xff\xd8\xff garbage"]), timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Predict(predict_request(jpegs=images[:1]), timeout=30).outputs["classid"].int64_val


def test_ten_megabyte_image(stub):
    noise = np.random.default_rng(3).integers(0, 256, (2400, 2400, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=100)
    big = buffer.getvalue()
    assert len(big) > 10 * MB
    response = stub.Predict(predict_request(jpegs=[big]), timeout=60)
    assert tf.make_ndarray(response.outputs["probabilities"]).shape == (1, len(CLASSES))


def test_deadline_exceeded_on_the_server(stub, images, server):
    started = time.monotonic()
    err = rpc_error(stub.Predict, predict_request(jpegs=images[:1]), timeout=BATCH_TIMEOUT_S / 5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < BATCH_TIMEOUT_S
    # The server saw it too (not only the client's timer): its request count records the status.
    metrics = requests.get(f"{server.rest_url}/monitoring/prometheus/metrics", timeout=10).text
    assert 'status="DEADLINE_EXCEEDED"' in metrics


def test_bytes_that_are_no_message_are_invalid_argument_not_internal(channel, stub, images):
    """A client that sends garbage (not a PredictRequest) gets INVALID_ARGUMENT, where grpcio's own deserializer
    answers INTERNAL "Exception deserializing request!"; the server keeps serving."""
    raw_predict = channel.unary_unary("/tensorflow.serving.PredictionService/Predict",
                                      request_serializer=lambda data: data, response_deserializer=lambda data: data)
    with pytest.raises(grpc.RpcError) as error:
        raw_predict(b"\xff\xff\xff\xff not a protobuf", timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert "not a valid message" in error.value.details()
    request = predict_pb2.PredictRequest(model_spec={"name": "flowers"})
    request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto(images[:1]))
    assert stub.Predict(request, timeout=30).outputs["probabilities"].tensor_shape.dim[0].size == 1


def test_get_model_status(model_stub):
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "flowers"
    response = model_stub.GetModelStatus(request, timeout=30)
    [status] = response.model_version_status
    assert status.version == 1
    assert status.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    assert status.status.error_code == 0 and status.status.error_message == ""
    request.model_spec.name = "nope"
    assert rpc_error(model_stub.GetModelStatus, request, timeout=30).code() == grpc.StatusCode.NOT_FOUND


def test_get_model_metadata(stub):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "flowers"
    response = stub.GetModelMetadata(request, timeout=30)
    assert response.model_spec.version.value == 1
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    default = signatures.signature_def["serving_default"]
    assert default.method_name == "tensorflow/serving/predict"
    assert default.inputs["image_bytes"].dtype == tf.string.as_datatype_enum
    assert [d.size for d in default.inputs["image_bytes"].tensor_shape.dim] == [-1]
    assert [d.size for d in default.outputs["probabilities"].tensor_shape.dim] == [-1, len(CLASSES)]
    assert default.outputs["classid"].dtype == tf.int64.as_datatype_enum
    images_input = signatures.signature_def["predict_images"].inputs["images"]
    assert [d.size for d in images_input.tensor_shape.dim] == [-1, IMAGE_SIZE, IMAGE_SIZE, 3]
    request.metadata_field[:] = ["something_else"]
    assert rpc_error(stub.GetModelMetadata, request, timeout=30).code() == grpc.StatusCode.INVALID_ARGUMENT


def image_examples(images: list[bytes]) -> input_pb2.Input:
    return input_pb2.Input(example_list=input_pb2.ExampleList(examples=[
        example_pb2.Example(features=feature_pb2.Features(feature={
            "image_bytes": feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[image]))}))
        for image in images]))


def test_classify_ranks_every_class(stub, images, local_probabilities):
    request = classification_pb2.ClassificationRequest(input=image_examples(images))
    request.model_spec.name = "flowers"
    response = stub.Classify(request, timeout=30)
    assert response.model_spec.version.value == 1
    assert len(response.result.classifications) == len(images)
    for row, expected in zip(response.result.classifications, local_probabilities, strict=False):
        labels = [c.label for c in row.classes]
        scores = np.array([c.score for c in row.classes])
        assert sorted(labels) == sorted(CLASSES)
        assert labels[0] == CLASSES[int(expected.argmax())]
        assert np.all(np.diff(scores) <= 0)
        np.testing.assert_allclose(scores, [expected[CLASSES.index(label)] for label in labels], rtol=1e-5)
    empty = classification_pb2.ClassificationRequest()
    empty.model_spec.name = "flowers"
    assert rpc_error(stub.Classify, empty, timeout=30).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_regress_refuses_an_image_signature_and_multi_inference_classifies_images(stub, images):
    request = regression_pb2.RegressionRequest(input=image_examples(images[:1]))
    request.model_spec.name = "flowers"
    err = rpc_error(stub.Regress, request, timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == "Expected one output Tensor."
    request.model_spec.name = "nope"
    assert rpc_error(stub.Regress, request, timeout=30).code() == grpc.StatusCode.NOT_FOUND
    multi = inference_pb2.MultiInferenceRequest(input=image_examples(images[:2]))
    task = multi.tasks.add(method_name="tensorflow/serving/classify")
    task.model_spec.name = "flowers"
    response = stub.MultiInference(multi, timeout=30)
    classify = classification_pb2.ClassificationRequest(input=image_examples(images[:2]))
    classify.model_spec.name = "flowers"
    expected = stub.Classify(classify, timeout=30).result
    assert [r.classification_result for r in response.results] == [expected]
    assert response.results[0].model_spec.signature_name == "serving_default"


def test_reload_config_loads_listed_and_unloads_omitted(model_stub, stub, model_base, images):
    config = model_server_config_pb2.ModelServerConfig()
    for name in ("flowers", "second"):
        config.model_config_list.config.add(name=name, base_path=model_base, model_platform="tensorflow")
    model_stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=60)
    wait_until(lambda: stub.Predict(predict_request("second", jpegs=images[:1]), timeout=30))
    del config.model_config_list.config[1]
    model_stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=60)
    wait_until(lambda: rpc_error(stub.Predict, predict_request("second", jpegs=images[:1]),
                                 timeout=30).code() == grpc.StatusCode.NOT_FOUND)
    assert stub.Predict(predict_request(jpegs=images[:1]), timeout=30).outputs["classid"].int64_val


def wait_until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (grpc.RpcError, AssertionError, pytest.fail.Exception):
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.2)


def model_status(target: str) -> get_model_status_pb2.GetModelStatusResponse:
    with grpc.insecure_channel(target) as ch:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "flowers"
        return model_service_pb2_grpc.ModelServiceStub(ch).GetModelStatus(request, timeout=10)


def test_two_workers_bind_only_the_host_given_and_a_reload_reaches_both(model_base):
    """--host applies to gRPC as to REST; a reload RPC lands on one worker of two, and both serve the new config."""
    with run_server(f"--model_base_path={model_base}", "--model_name=flowers", "--workers=2",
                    "--host=127.0.0.2", "--enable_model_control") as srv:
        [status] = model_status(srv.grpc_target).model_version_status  # the other worker may still be loading
        assert status.version == 1
        err = rpc_error(model_status, f"127.0.0.1:{srv.grpc_port}")
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(requests.ConnectionError):
            requests.get(srv.rest_url.replace("127.0.0.2", "127.0.0.1") + "/healthz", timeout=5)

        config = model_server_config_pb2.ModelServerConfig()
        for name in ("flowers", "other"):
            config.model_config_list.config.add(name=name, base_path=model_base, model_platform="tensorflow")
        with grpc.insecure_channel(srv.grpc_target) as ch:
            model_service_pb2_grpc.ModelServiceStub(ch).HandleReloadConfigRequest(
                model_management_pb2.ReloadConfigRequest(config=config), timeout=30)

        def every_connection_serves_other() -> bool:
            """Fresh channels land on either worker (SO_REUSEPORT hashes each connection): 20 in a row all serving
            "other" would happen by chance with one worker left behind once in 2**19 runs."""
            for _ in range(20):
                with grpc.insecure_channel(srv.grpc_target) as ch:
                    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="other"),
                                                                   timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            return True
        wait_until(every_connection_serves_other, timeout=60)


def test_health_serving_then_not_serving_during_graceful_shutdown(model_base):
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with run_server(f"--model_base_path={model_base}", "--model_name=flowers") as srv:
        with grpc.insecure_channel(srv.grpc_target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == serving
            assert health.Check(health_pb2.HealthCheckRequest(service="flowers"), timeout=10).status == serving
            err = rpc_error(health.Check, health_pb2.HealthCheckRequest(service="unknown"), timeout=10)
            assert err.code() == grpc.StatusCode.NOT_FOUND
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(watch).status == serving
            srv.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == not_serving
            assert srv.proc.wait(30) == 0

