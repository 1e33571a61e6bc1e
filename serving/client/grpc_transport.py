"""The client's gRPC calls: TF Serving's Classify, whose messages are TensorFlow's and TF Serving's protos. Importing
them loads TensorFlow, so a client loads this module only once it is asked for gRPC."""
from __future__ import annotations

from typing import Any

from serving.tensorflow_logs import import_tensorflow


def classify_stub(channel: Any) -> Any:
    """TF Serving's PredictionService stub on `channel`, TensorFlow imported without its C++ start-up lines."""
    import_tensorflow()
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


def classify_request(model: str, version: int | None, images: list[bytes]) -> Any:
    """A ClassificationRequest of one Example per image, each JPEG under `image_bytes`, as the export's classify
    signature reads them."""
    from tensorflow.core.example import example_pb2, feature_pb2
    from tensorflow_serving.apis import classification_pb2, input_pb2, model_pb2

    spec = model_pb2.ModelSpec(name=model)
    if version is not None:
        spec.version.value = version
    examples = [example_pb2.Example(features=feature_pb2.Features(feature={
        "image_bytes": feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[image]))}))
        for image in images]
    return classification_pb2.ClassificationRequest(
        model_spec=spec, input=input_pb2.Input(example_list=input_pb2.ExampleList(examples=examples)))
