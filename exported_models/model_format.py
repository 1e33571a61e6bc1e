"""The exported-model contract: the one place that says how a model is laid out on disk.

Training writes through it, and the server, `petal predict` and batch jobs read through it, so the layout cannot
drift between the two sides. It imports TensorFlow's file and proto modules only: never Keras (the server does not
need it) and never Flask or Beam.

Layout (TF Serving's): `<base>/<name>/<version>/` where `<version>` is an integer directory (Petal writes plain
digits and reads zero-padded ones too, `00000123`; the path is always the folder as found) holding
`saved_model.pb`, `variables/`, `assets/labels.txt` (one class name per line, in class-id order) and
`assets.extra/tf_serving_warmup_requests` (a TFRecord of `tensorflow.serving.PredictionLog`); Petal's exports also
write `assets.extra/petal_scaled_jpeg_inputs.json` (SCALED_JPEG_FILE), which TF Serving does not read.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow_serving.apis import input_pb2, predict_pb2, prediction_log_pb2

from exported_models import DEFAULT_MODEL_BASE_PATH, DEFAULT_MODEL_NAME  # noqa: F401 (part of the contract)

SAVED_MODEL_FILE = "saved_model.pb"
# A SavedModel written as text, which TensorFlow's loader reads where there is no saved_model.pb (its
# MaybeSavedModelDirectory and ReadSavedModel, which TF Serving's SavedModelBundle loader calls).
SAVED_MODEL_TEXT_FILE = "saved_model.pbtxt"
SAVED_MODEL_FILES = (SAVED_MODEL_FILE, SAVED_MODEL_TEXT_FILE)
TFLITE_FILE = "model.tflite"  # TF Serving's name for a version's TFLite model (--prefer_tflite_model)
VERSION_MARKERS = (*SAVED_MODEL_FILES, TFLITE_FILE)  # a version folder holding none of these is not published yet
LABELS_FILE = "labels.txt"
LABELS_ASSET = f"assets/{LABELS_FILE}"
WARMUP_FILE = "assets.extra/tf_serving_warmup_requests"
MAX_WARMUP_RECORDS = 1000  # TF Serving replays at most this many
# {signature: {input: [height, width]}}: the string inputs whose JPEGs the graph decodes at the smallest DCT scaling
# still at least that size (training/preprocessing.decode_at_least), so the server's memory budget charges them at
# that size. Recorded by the export because nothing else tells: a signature decoding in full looks the same from
# outside, and charging it the scaled size would let it decode past the budget.
SCALED_JPEG_FILE = "assets.extra/petal_scaled_jpeg_inputs.json"
DEFAULT_SIGNATURE = "serving_default"
IMAGE_INPUT = "image_bytes"  # the JPEG (PNG, GIF, BMP) bytes that an image classifier's signature takes
_INTERNAL_SIGNATURES = ("__saved_model_init_op",)
# Warmup records over tf.Examples, with the method of their one task (MultiInference names its own).
_EXAMPLE_LOGS = {"classify_log": "tensorflow/serving/classify", "regress_log": "tensorflow/serving/regress",
                 "multi_inference_log": ""}

logger = logging.getLogger(__name__)
_warned_duplicates: set[tuple[str, str, tuple[str, ...]]] = set()



@dataclass
class TensorInfo:
    name: str
    dtype: str  # e.g. "DT_STRING"
    shape: list[int] | None  # -1 = any; None = unknown rank


@dataclass
class SignatureInfo:
    inputs: dict[str, TensorInfo]
    outputs: dict[str, TensorInfo]
    method_name: str
    defaults: dict[str, object] = field(default_factory=dict)  # TensorProto by input name (TF 2.21's field)

    @functools.cached_property
    def default_arrays(self) -> dict[str, np.ndarray]:
        """The defaults as arrays, decoded once: every request that leaves such an input out takes them."""
        return {name: tf.make_ndarray(proto) for name, proto in self.defaults.items()}


# --- layout ---------------------------------------------------------------------------------------------------

def version_dirs(base_path: str) -> dict[int, str]:
    """Each published version under a base path and the folder it was found in, as TF Serving finds them.

    A version is a child folder whose whole name is a base-10 integer, leading zeros included (`00000123` is
    version 123), holding a saved_model.pb, a saved_model.pbtxt or a model.tflite; anything else (a staging
    sibling, a version still being copied) is not a version yet. When two folders name one version (`7` and
    `007`), the name that sorts last wins, as in TF Serving, and a warning says which folder was ignored.
    """
    base = base_path.rstrip("/")
    try:
        names = [name.rstrip("/") for name in tf.io.gfile.listdir(base)]
    except tf.errors.OpError:
        return {}
    published = [name for name in names if _is_version_name(name) and any(
        tf.io.gfile.exists(f"{base}/{name}/{marker}") for marker in VERSION_MARKERS)]
    return {version: f"{base}/{name}" for version, name in _pick_versions(base, published).items()}


def versions_in_listing(base_path: str, files: Iterable[str]) -> dict[int, str]:
    """version_dirs over a listing of every file under a base path (relative paths, `/`-separated), as an object
    store gives it in one call: each published version and its folder's name."""
    published = {path.split("/", 1)[0] for path in files
                 if path.count("/") == 1 and path.split("/", 1)[1] in VERSION_MARKERS}
    return _pick_versions(base_path, [name for name in published if _is_version_name(name)])


def _is_version_name(name: str) -> bool:
    return name.isascii() and name.isdigit()


def _pick_versions(base_path: str, names: Iterable[str]) -> dict[int, str]:
    """Published version folders' names by version, ascending; of two names for one version the one that sorts
    last, with a warning."""
    by_version: dict[int, list[str]] = {}
    for name in sorted(names):
        by_version.setdefault(int(name), []).append(name)
    for version, found in by_version.items():
        if len(found) > 1:
            _warn_duplicates(base_path.rstrip("/"), version, found[-1], tuple(found[:-1]))
    return {version: found[-1] for version, found in sorted(by_version.items())}


def _warn_duplicates(base: str, version: int, used: str, ignored: tuple[str, ...]) -> None:
    """Once per process and set of folders: the source polls every second."""
    if (base, used, ignored) in _warned_duplicates:
        return
    _warned_duplicates.add((base, used, ignored))
    logger.warning("duplicate version folders", extra={"fields": {
        "base_path": base, "version": version, "loaded_from": used, "ignored": list(ignored)}})


def exported_versions(base_path: str) -> list[int]:
    """The published versions under a base path, ascending (see version_dirs)."""
    return list(version_dirs(base_path))


def latest_version(model_path: str) -> str:
    """A version directory as is, or a base path's highest published version (TF Serving's latest policy)."""
    path = model_path.rstrip("/")
    if any(tf.io.gfile.exists(f"{path}/{name}") for name in SAVED_MODEL_FILES):
        return path
    versions = version_dirs(path)
    if not versions:
        raise FileNotFoundError(f"no SavedModel in {model_path!r} (neither a saved_model.pb nor integer version "
                                "directories holding one)")
    return versions[max(versions)]


def next_version(base_path: str) -> int:
    """One more than the highest integer directory (`007` counts as 7), as TF Serving orders versions; 1 for a
    new base."""
    if not os.path.isdir(base_path):
        return 1
    return max((int(d) for d in os.listdir(base_path) if d.isascii() and d.isdigit()), default=0) + 1


# --- labels ---------------------------------------------------------------------------------------------------

def write_labels(path: str, labels: list[str]) -> None:
    if not labels or any("\n" in label or not label for label in labels):
        raise ValueError("labels must be non-empty strings without newlines")
    with tf.io.gfile.GFile(path, "w") as f:
        f.write("\n".join(labels) + "\n")


def read_labels(path: str) -> list[str]:
    """One label per line in label-id order, from any file system tf.io.gfile reads (blank lines skipped).

    TensorFlow's file errors become OSErrors, so command lines can report a bad path like any other.
    """
    try:
        with tf.io.gfile.GFile(path) as f:
            labels = [line.strip() for line in f if line.strip()]
    except tf.errors.NotFoundError:
        raise FileNotFoundError(f"no labels file at {path}") from None
    except tf.errors.OpError as error:
        raise OSError(f"cannot read labels file {path}: {error.message}") from None
    if not labels:
        raise ValueError(f"{path} holds no labels")
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path} lists a label twice")
    return labels


def class_names(version_dir: str) -> list[str]:
    """A version's class names; a SavedModel from elsewhere may have none, and is served without them."""
    path = f"{version_dir.rstrip('/')}/{LABELS_ASSET}"
    return read_labels(path) if tf.io.gfile.exists(path) else []


# --- the JPEG scaling of image inputs --------------------------------------------------------------------------

ScaledJpegInputs = dict[str, dict[str, tuple[int, int]]]


def write_scaled_jpeg_inputs(version_dir: str, inputs: ScaledJpegInputs) -> None:
    path = f"{version_dir.rstrip('/')}/{SCALED_JPEG_FILE}"
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.gfile.GFile(path, "w") as f:
        json.dump(inputs, f)


def scaled_jpeg_inputs(version_dir: str) -> ScaledJpegInputs:
    """SCALED_JPEG_FILE's inputs; none for a version without it (any other exporter's, or Petal's before it decoded
    JPEGs scaled), whose every JPEG is then charged in full."""
    path = f"{version_dir.rstrip('/')}/{SCALED_JPEG_FILE}"
    if not tf.io.gfile.exists(path):
        return {}
    with tf.io.gfile.GFile(path) as f:
        recorded = json.load(f)
    return {signature: {name: (int(height), int(width)) for name, (height, width) in inputs.items()}
            for signature, inputs in recorded.items()}


# --- signatures -----------------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    """TF's name of a dtype (DT_DOUBLE for float64), the one SignatureDefs and TF Serving's messages use."""
    return types_pb2.DataType.Name(tf.as_dtype(dtype).as_datatype_enum)


def _tensor_info(proto) -> TensorInfo:
    shape = None if proto.tensor_shape.unknown_rank else [int(d.size) for d in proto.tensor_shape.dim]
    return TensorInfo(name=proto.name, dtype=types_pb2.DataType.Name(proto.dtype), shape=shape)


def read_saved_model(version_dir: str) -> saved_model_pb2.SavedModel:
    """A version's saved_model.pb, or else its saved_model.pbtxt, in TensorFlow's order (ReadSavedModel); with
    neither, TensorFlow's NotFoundError for the binary file."""
    saved_model = saved_model_pb2.SavedModel()
    base = version_dir.rstrip("/")
    if not tf.io.gfile.exists(f"{base}/{SAVED_MODEL_FILE}") and tf.io.gfile.exists(f"{base}/{SAVED_MODEL_TEXT_FILE}"):
        with tf.io.gfile.GFile(f"{base}/{SAVED_MODEL_TEXT_FILE}") as f:
            return text_format.Parse(f.read(), saved_model)
    with tf.io.gfile.GFile(f"{base}/{SAVED_MODEL_FILE}", "rb") as f:
        saved_model.ParseFromString(f.read())
    return saved_model


def meta_graph(saved_model: saved_model_pb2.SavedModel, tags: set[str] | None = None) -> meta_graph_pb2.MetaGraphDef:
    """The meta graph whose tag set is exactly `tags` (TensorFlow's loaders match it so); the first without."""
    if tags is None:
        return saved_model.meta_graphs[0]
    for graph in saved_model.meta_graphs:
        if set(graph.meta_info_def.tags) == tags:
            return graph
    available = [sorted(graph.meta_info_def.tags) for graph in saved_model.meta_graphs]
    raise ValueError(f"no meta graph with tags {sorted(tags)}; the SavedModel has {available}")


def signature_infos(graph: meta_graph_pb2.MetaGraphDef, internal: bool = False) -> dict[str, SignatureInfo]:
    """A meta graph's signature defs: the tensor names, dtypes and method names TF Serving reports. The internal
    ones (TF2's `__saved_model_init_op`, which runs once at load) only with `internal`: TF Serving's metadata lists
    the whole map, and no request can call them."""
    infos = {key: signature_info(sig) for key, sig in graph.signature_def.items()}
    return infos if internal else callable_signatures(infos)


def signature_info(sig: meta_graph_pb2.SignatureDef) -> SignatureInfo:
    """One SignatureDef as TF Serving reports it (a SavedModel's, or one a TFLite file stores in its metadata)."""
    return SignatureInfo(inputs={k: _tensor_info(v) for k, v in sig.inputs.items()},
                         outputs={k: _tensor_info(v) for k, v in sig.outputs.items()},
                         method_name=sig.method_name, defaults=dict(sig.defaults))


def callable_signatures(infos: dict[str, SignatureInfo]) -> dict[str, SignatureInfo]:
    """The signatures a request may call, of a whole signature_def map (`signature_infos(internal=True)`)."""
    return {key: info for key, info in infos.items() if key not in _INTERNAL_SIGNATURES}


def read_signatures(version_dir: str, tags: set[str] | None = None) -> dict[str, SignatureInfo]:
    """Signature defs straight from saved_model.pb, of the meta graph with these tags (the first without)."""
    return signature_infos(meta_graph(read_saved_model(version_dir), tags))


# --- warmup ---------------------------------------------------------------------------------------------------

@dataclass
class WarmupRequest:
    """A Predict record (`inputs`), or a Classify, Regress or MultiInference one: its (method name, signature)
    tasks over the tf.Examples of `examples` (a tensorflow.serving.Input)."""
    signature_name: str
    inputs: dict[str, np.ndarray]
    tasks: list[tuple[str, str]] = field(default_factory=list)
    examples: input_pb2.Input | None = None


def write_warmup(version_dir: str, model_name: str, requests: list[WarmupRequest]) -> str:
    """Write the warmup file as `PredictionLog` records, the format TF Serving replays too."""
    path = _warmup_path(version_dir)
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.TFRecordWriter(path) as writer:
        for warmup in requests[:MAX_WARMUP_RECORDS]:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = model_name
            request.model_spec.signature_name = warmup.signature_name
            for name, value in warmup.inputs.items():
                request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
            record = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(record.SerializeToString())
    return path


def has_warmup(version_dir: str) -> bool:
    """Whether the version carries warmup requests: TF Serving times and counts a warmup only then."""
    return tf.io.gfile.exists(_warmup_path(version_dir))


def _warmup_path(version_dir: str) -> str:
    return f"{version_dir.rstrip('/')}/{WARMUP_FILE}"


def read_warmup(version_dir: str) -> Iterator[WarmupRequest]:
    """The version's warmup requests (at most MAX_WARMUP_RECORDS): Predict, Classify, Regress and MultiInference
    records, as TF Serving replays them (any other record is an error); none when it has no warmup file."""
    if not has_warmup(version_dir):
        return
    for record in tf.data.TFRecordDataset(_warmup_path(version_dir)).take(MAX_WARMUP_RECORDS).as_numpy_iterator():
        log = prediction_log_pb2.PredictionLog.FromString(record)
        kind = log.WhichOneof("log_type")
        if kind == "predict_log":
            request = log.predict_log.request
            yield WarmupRequest(request.model_spec.signature_name or DEFAULT_SIGNATURE,
                                {k: tf.make_ndarray(v) for k, v in request.inputs.items()})
        elif kind in _EXAMPLE_LOGS:
            request = getattr(log, kind).request
            tasks = ([(t.method_name, t.model_spec.signature_name or DEFAULT_SIGNATURE) for t in request.tasks]
                     if kind == "multi_inference_log" else
                     [(_EXAMPLE_LOGS[kind], request.model_spec.signature_name or DEFAULT_SIGNATURE)])
            yield WarmupRequest(tasks[0][1] if tasks else DEFAULT_SIGNATURE, {}, tasks, request.input)
        else:  # a session_run_log, say: TF Serving fails the load on it too
            raise ValueError(f"Unsupported log_type for warmup: {kind}")
