"""What KServe V2 over REST (rest/kserve.py) and over gRPC (grpc_api/kserve.py) answer alike, as JSON-ready dicts:
model metadata and Triton's model-configuration and statistics extensions, and how a model's inputs take Triton's
dims. (The tensors themselves are the codecs': codec/v2_tensors.py.)

The dicts use the field names of Triton's protos (model_config.proto, grpc_service.proto) with int64 values as
JSON numbers, which is the JSON Triton's HTTP endpoints write; grpc_api/kserve.py parses the same dicts into the
gRPC messages, so REST and gRPC cannot disagree.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from serving.core import DEFAULT_SIGNATURE, DataPlane, PredictResult, SignatureInfo, TensorInfo, invalid
from serving.protocols.codec.v2_tensors import DATATYPES, datatype_of

PLATFORM = "tensorflow_savedmodel"
# What the server metadata lists: the V2 extensions Petal serves, by Triton's names.
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "statistics"]


def served_signature(signatures: dict[str, SignatureInfo]) -> SignatureInfo:
    """The signature a V2 model stands for when the request names none."""
    return signatures.get(DEFAULT_SIGNATURE) or next(iter(signatures.values()))


def batches(dataplane: DataPlane, signature: SignatureInfo) -> bool:
    """Whether the model batches in Triton's sense: batching is on and every input has a leading -1."""
    return dataplane.options.enable_batching and bool(signature.inputs) and all(
        t.shape and t.shape[0] == -1 for t in signature.inputs.values())


def answered_by_a_batching_model(dataplane: DataPlane, result: PredictResult) -> Callable[[], bool]:
    """Whether the signature that answered batches (`batches`), asked only by the classification extension, which
    ranks each row of a batching model's output and the whole output of any other, as Triton does."""
    def batched() -> bool:
        _, signatures = dataplane.signatures(result.model, result.version)
        return batches(dataplane, signatures[result.signature_name])
    return batched


def model_metadata(dataplane: DataPlane, model: str, version: int | None) -> dict[str, Any]:
    """V2 model metadata; without a version, `versions` lists every AVAILABLE one. Shapes are the signature's,
    except that an input of one value per row of a batching model is [-1, 1], as Triton derives it from the
    model configuration's dims [1] (perf_analyzer reads the shape there, and needs a dimension past the batch)."""
    resolved, signatures = dataplane.signatures(model, version)
    signature = served_signature(signatures)
    batched = batches(dataplane, signature)

    def shape(t: TensorInfo, is_input: bool) -> list[int]:
        if t.shape is None:
            return [-1]
        return [-1, 1] if is_input and batched and one_per_row(t) else list(t.shape)

    def tensors(infos: dict[str, TensorInfo], is_input: bool) -> list[dict[str, Any]]:
        return [{"name": name, "datatype": DATATYPES.get(t.dtype, t.dtype), "shape": shape(t, is_input)}
                for name, t in infos.items()]

    versions = [str(v) for v in dataplane.available_versions(model)] if version is None else [str(resolved)]
    return {"name": model, "versions": versions, "platform": PLATFORM, "inputs": tensors(signature.inputs, True),
            "outputs": tensors(signature.outputs, False)}


def config_type(tf_dtype: str) -> str:
    """Triton's DataType name (TYPE_FP32, TYPE_STRING) for a TF dtype name."""
    datatype = DATATYPES.get(tf_dtype, "INVALID")
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def one_per_row(t: TensorInfo | None) -> bool:
    """A batched input of one value per row ([-1]), which Triton's configuration has as dims [1] reshaped to []."""
    return t is not None and t.shape == [-1]


def with_triton_dims(inputs: dict[str, np.ndarray], model: str) -> Callable[[SignatureInfo], dict[str, np.ndarray]]:
    """The inputs as DataPlane.predict's function of the signature: an input of one value per row may come shaped
    [rows, 1], the dims the model configuration declares (as perf_analyzer sends it), or [rows]. An input of
    another datatype than the model's is refused, with Triton's text (core infer_request.cc), rather than cast:
    numpy's float64 sent as FP64 to an FP32 input lost precision unseen."""
    def for_signature(info: SignatureInfo) -> dict[str, np.ndarray]:
        for name, array in inputs.items():
            tensor = info.inputs.get(name)
            expected = DATATYPES.get(tensor.dtype, tensor.dtype) if tensor is not None else None
            if expected is not None and datatype_of(array) != expected:
                raise invalid(f"inference input '{name}' data-type is '{datatype_of(array)}', but model '{model}' "
                              f"expects '{expected}'")
        return {name: array.reshape(len(array)) if one_per_row(info.inputs.get(name)) and array.ndim == 2
                and array.shape[1] == 1 else array for name, array in inputs.items()}
    return for_signature


def model_config(dataplane: DataPlane, model: str, version: int | None) -> dict[str, Any]:
    """Triton's ModelConfig of the served signature of `version` (the latest when None).

    With batching on and every input batched (`batches`), the model batches in Triton's sense: max_batch_size
    is the batcher's, dims leave the batch dimension out, and dynamic_batching carries allowed_batch_sizes and
    batch_timeout_micros; an input of one value per row is dims [1] reshaped to [], since Triton's tools need
    dims (`with_triton_dims` takes it either way). Otherwise max_batch_size is 0 and dims are the whole shapes, as
    Triton has them for a model it does not batch.
    """
    _, signatures = dataplane.signatures(model, version)
    signature = served_signature(signatures)
    batching = dataplane.options.batching
    batched = batches(dataplane, signature)

    def tensor(name: str, t: TensorInfo) -> dict[str, Any]:
        if t.shape is None:
            dims = [-1]
        else:
            dims = list(t.shape[1:]) if batched and t.shape and t.shape[0] == -1 else list(t.shape)
        return {"name": name, "data_type": config_type(t.dtype), "dims": dims}

    def config_input(name: str, t: TensorInfo) -> dict[str, Any]:
        entry = tensor(name, t)
        return {**entry, "dims": [1], "reshape": {"shape": []}} if batched and one_per_row(t) else entry

    config: dict[str, Any] = {"name": model, "platform": PLATFORM, "backend": "tensorflow",
                              "max_batch_size": batching.max_batch_size if batched else 0,
                              "input": [config_input(n, t) for n, t in signature.inputs.items()],
                              "output": [tensor(n, t) for n, t in signature.outputs.items()]}
    if batched:
        config["dynamic_batching"] = {"preferred_batch_size": list(batching.allowed_batch_sizes),
                                      "max_queue_delay_microseconds": batching.batch_timeout_micros}
    return config


def model_statistics(dataplane: DataPlane, model: str | None, version: int | None) -> dict[str, Any]:
    """Triton's ModelStatisticsResponse: every AVAILABLE version of `model` (of every model when None).

    Petal times a model execution as one call, input conversion included, so compute_input and compute_output
    count the requests with no time of their own; Petal has no response cache, so its counts are 0.
    """
    def duration(count: int, us: float) -> dict[str, int]:
        return {"count": count, "ns": round(us * 1000)}

    def untimed(count: int) -> dict[str, int]:
        return duration(count, 0.0)

    entries = []
    for name, number, s in dataplane.statistics(model, version):
        entries.append({
            "name": name, "version": str(number), "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count, "execution_count": sum(b.count for b in s.batches.values()),
            "inference_stats": {
                "success": duration(s.success.count, s.success.us), "fail": duration(s.fail.count, s.fail.us),
                "queue": duration(s.queue.count, s.queue.us), "compute_input": untimed(s.compute.count),
                "compute_infer": duration(s.compute.count, s.compute.us),
                "compute_output": untimed(s.compute.count), "cache_hit": untimed(0), "cache_miss": untimed(0)},
            "batch_stats": [{"batch_size": size, "compute_input": untimed(b.count),
                             "compute_infer": duration(b.count, b.us), "compute_output": untimed(b.count)}
                            for size, b in sorted(s.batches.items())]})
    return {"model_stats": entries}
