"""The batch job's engine-free steps: what one record goes through, whichever engine moves the records.

Beam's DoFns (job, sources, model_handler) and Spark's partition function (spark_job) call these functions and
nothing else for the work itself, so both engines read, key, decode, batch, predict and format alike:

- reading and keying the input formats, where every input becomes either a `(key, payload)` record (the image
  bytes; for any other SavedModel, a Predict instance or a serialized tf.Example: serving/batch_prediction/any_model.py)
  or a `Failure` carrying its key and reason, so that results + errors always add up to the number of inputs. Keys are
  what a user can trace back: the file path, the TFRecord's `key` or `image/filename` feature, or the JSON line's
  `key`; a record without one is keyed by `<file>:<index>`;
- decoding on the host with the server's preprocessing (TPUs cannot decode JPEGs);
- the model on static padded batches: accelerators compile one program per input shape, so the last partial batch
  is padded and the padding rows are dropped again before anything is returned;
- a result or an error as one JSON line, and the job's summary, which says whether rows in = results + errors.

Any other SavedModel's parts (any_model, and the server's runtimes and codecs behind it) are imported only by a job
that runs one, so that an image job's workers start without them (docs/batch.md, 'Lean workers').

Every file is read and written through exported_models/storage.py, on a disk or an object store (`s3://`, `gs://`,
`az://`), by both engines alike: a model given as a URL is copied into a local folder once per process (TensorFlow
reads only local files: 2.21 has no `s3://`), and so is a TFRecord file, which TensorFlow's reader checks record by
record; images, JSON Lines and file lists are streamed.
"""
from __future__ import annotations

import atexit
import base64
import binascii
import bz2
import contextlib
import gzip
import io
import json
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.example import example_pb2

from exported_models import storage
from exported_models.model_format import (
    DEFAULT_SIGNATURE,
    LABELS_ASSET,
    SAVED_MODEL_FILES,
    class_names,
    latest_version,
    read_labels,
    read_signatures,
    versions_in_listing,
)
from serving.core.errors import ServingError, op_error_message
from serving.core.images import check_pixels
from training.preprocessing import preprocess_eval

logger = logging.getLogger(__name__)

SIGNATURE = "predict_images"
SIGNATURE_INPUT = "images"
IMAGES = "images"  # the mode of Petal's image classifiers; any other model's is one of any_model.METHODS
# The numeric outputs come back from the device; class names are looked up on the host, because string
# tensors cannot live on a TPU.
DEVICE_OUTPUTS = ("probabilities", "classid")
RESULTS_PREFIX = "prediction.results"
ERRORS_PREFIX = "prediction.errors_stats"
ERRORS_FILE = f"{ERRORS_PREFIX}-00000-of-00001"
FORMATS = ("images", "filelist", "tfrecord", "jsonl")
_EXTENSIONS = {".tfrecord": "tfrecord", ".tfrecords": "tfrecord", ".tfr": "tfrecord", ".jsonl": "jsonl",
               ".json": "jsonl", ".txt": "filelist", ".lst": "filelist", ".list": "filelist"}
# Read decompressed by both engines, as Beam's FileSystems.open reads them
COMPRESSED: dict[str, Callable[[IO[bytes]], io.BufferedIOBase]] = {".gz": lambda raw: gzip.GzipFile(fileobj=raw),
                                                                   ".bz2": bz2.BZ2File}
# Where each engine's tasks write their files before they are committed under their final names
TEMPORARY = "_temporary"
# A TFRecord is its length (8 bytes) and the length's CRC (4), the data, and the data's CRC (4).
_TFRECORD_HEADER = 12
_TFRECORD_FRAMING = _TFRECORD_HEADER + 4


@dataclass(frozen=True)
class Failure:
    """One input that produced no prediction, with a gRPC status name as TF Serving would report it."""

    key: Any
    status: str
    message: str

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "error": {"status": self.status, "message": self.message}})

    @classmethod
    def of(cls, key: Any, error: ServingError) -> Failure:
        return cls(key, error.code.name, error.message)


Record = tuple[Any, bytes]


def shared_path(path: str) -> bool:
    """A store's URL (`s3://…`, `gs://…`) or a `file:///…` one (a folder every machine mounts at that path): every
    worker reads it as the driver does, so it is never rewritten, and a model there is never shipped."""
    return storage.is_remote(path) or storage.local_path(path) != path


def infer_format(pattern: str) -> str:
    """The format a pattern's extension implies, under a compressed file's (`.jsonl.gz`); anything unrecognised is
    taken to be image files."""
    stem, extension = posixpath.splitext(pattern.rstrip("*"))
    if extension.lower() in COMPRESSED:
        extension = posixpath.splitext(stem)[1]
    return _EXTENSIONS.get(extension.lower(), "images")


# --- reading ------------------------------------------------------------------------------------------------

def list_files(pattern: str) -> list[str]:
    """What an --input pattern names, for both engines alike: every match but folders, sorted; on a store, what its
    listing matches. Locally TensorFlow's matching, which keeps a link to a deleted file (Beam's own matching left it
    out, which the Spark job kept: a record lost) and takes a folder named without a wildcard for none (a job of
    one error line)."""
    if storage.is_remote(pattern):
        return storage.glob(pattern)
    return sorted(f for f in tf.io.gfile.glob(pattern) if not tf.io.gfile.isdir(f))


@contextlib.contextmanager
def open_input(path: str) -> Iterator[IO[bytes] | io.BufferedIOBase]:
    """An input file's bytes from any store, streamed, decompressed when its name ends in .gz or .bz2."""
    with storage.open_file(path) as raw:
        decompress = _decompressor(path)
        yield decompress(raw) if decompress else raw


def _decompressor(path: str) -> Callable[[IO[bytes]], io.BufferedIOBase] | None:
    return COMPRESSED.get(posixpath.splitext(path)[1].lower())


@contextlib.contextmanager
def local_file(path: str) -> Iterator[str]:
    """A path TensorFlow's readers open: a local one as it is, a URL's object copied into a temporary file first,
    which is deleted once read."""
    if not storage.is_remote(path):
        yield storage.local_path(path)
        return
    with tempfile.NamedTemporaryFile(prefix="petal-input-") as copy:
        with storage.open_file(path) as source:
            shutil.copyfileobj(source, copy)
        copy.flush()
        yield copy.name


def read_file(path: str) -> Record | Failure:
    """A path to `(path, bytes)`; a file that cannot be read becomes a failure keyed by its path. Read in one call
    (on a store one request, where opening a file takes two)."""
    try:
        data = storage.read_bytes(path)
        decompress = _decompressor(path)
        return path, decompress(io.BytesIO(data)).read() if decompress else data
    except FileNotFoundError as e:
        return Failure(path, "NOT_FOUND", f"no such file: {e.filename or path}")
    except IsADirectoryError:
        return Failure(path, "INVALID_ARGUMENT", "is a directory, not an image file")
    except (OSError, EOFError, zlib.error) as e:
        return Failure(path, "UNAVAILABLE", f"cannot read the file: {e}")


def read_file_list(list_file: str) -> Iterator[str]:
    """The paths a file list names, one a line (blank lines passed over)."""
    with open_input(list_file) as f:
        for line in f:
            path = file_list_path(list_file, line.decode())
            if path:
                yield path


def file_list_path(list_file: str, line: str) -> str | None:
    """One line of a file list to a path; relative paths are relative to the list file, so lists travel."""
    path = line.strip()
    if not path:
        return None
    return path if shared_path(path) or posixpath.isabs(path) else posixpath.join(posixpath.dirname(list_file),
                                                                                  path)


def _example_key(features: Any, position: str) -> Any:
    """The record's `key` or `image/filename` feature, a string or an integer (an int64 key was passed over for
    the record's position), else its position."""
    for name in ("key", "image/filename"):
        if name not in features:  # reading a missing entry of a protobuf map would add it
            continue
        feature = features[name]
        if feature.bytes_list.value:
            return feature.bytes_list.value[0].decode("utf-8", "replace")
        if feature.int64_list.value:
            return int(feature.int64_list.value[0])
    return position


def _example_record(position: str, serialized: bytes, mode: str) -> Record | Failure:
    example = example_pb2.Example()
    try:
        example.ParseFromString(serialized)
    except DecodeError:
        return Failure(position, "INVALID_ARGUMENT", "record is not a serialized tf.train.Example")
    features = example.features.feature
    key = _example_key(features, position)
    if mode != IMAGES:
        return key, serialized
    encoded = features["image/encoded"].bytes_list.value if "image/encoded" in features else []
    if len(encoded) != 1:  # a second image was dropped without a word: a record is one image, one answer
        return Failure(key, "INVALID_ARGUMENT", "tf.train.Example has no image/encoded bytes" if not encoded else
                       f"tf.train.Example has {len(encoded)} images in image/encoded; a record holds one")
    return key, encoded[0]


def read_tfrecord_file(path: str, mode: str = IMAGES) -> Iterator[Record | Failure]:
    """Every tf.train.Example in one TFRecord file to `(key, image/encoded)` (other modes: the example as it is),
    streamed; a tail that is not whole records is one more failure, keyed by the next record's position.

    TensorFlow's reader stops without a word at a file cut inside a record header, so the bytes its records
    account for are compared with the file's size: whatever is left over is reported, with its byte offset.
    """
    with contextlib.ExitStack() as stack:
        try:
            local = stack.enter_context(local_file(path))
            size = os.path.getsize(local)
        except OSError as e:
            status = "NOT_FOUND" if isinstance(e, FileNotFoundError) else "UNAVAILABLE"
            yield Failure(f"{path}:0", status, f"cannot read the file: {e}")
            return
        index, offset = -1, 0
        try:
            for index, serialized in enumerate(tf.data.TFRecordDataset(local).as_numpy_iterator()):
                offset += len(serialized) + _TFRECORD_FRAMING
                yield _example_record(f"{path}:{index}", serialized, mode)
        except tf.errors.OpError as e:
            reason = op_error_message(e.message)
        else:
            if offset == size:
                return
            reason = f"the file ends {size - offset} bytes into a record's {_TFRECORD_HEADER}-byte header"
        after = f"after record {index}" if index >= 0 else "before any record"
        yield Failure(f"{path}:{index + 1}", "DATA_LOSS",
                      f"{path}: byte {offset} of {size} does not start a whole TFRecord ({after}): {reason}")


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _json_record(position: str, raw: bytes, mode: str) -> Record | Failure:
    """One line to a record keyed by its `key`, or by its place when it has none (null included); NaN and the
    infinities, which Python's reader takes, are not JSON: a NaN key was written back as NaN, an invalid line."""
    try:
        row = json.loads(raw, parse_constant=_not_json)
    except ValueError as e:
        return Failure(position, "INVALID_ARGUMENT", f"line is not valid JSON: {e}")
    if not isinstance(row, dict):
        return Failure(position, "INVALID_ARGUMENT", "line must be a JSON object with key and image_bytes")
    key = position if row.get("key") is None else row["key"]
    if mode != IMAGES:
        from serving.batch_prediction import any_model

        try:
            return key, any_model.record_payload(mode, row)
        except ServingError as error:
            return Failure.of(key, error)
    image = row.get("image_bytes")
    if not isinstance(image, dict) or not isinstance(image.get("b64"), str):
        return Failure(key, "INVALID_ARGUMENT", 'image_bytes must be {"b64": "<base64 string>"}')
    try:
        return key, base64.b64decode(image["b64"], validate=True)
    except (binascii.Error, ValueError) as e:
        return Failure(key, "INVALID_ARGUMENT", f"image_bytes.b64 is not valid base64: {e}")


def read_jsonl_file(path: str, mode: str = IMAGES) -> Iterator[Record | Failure]:
    """Every `{"key": …, "image_bytes": {"b64": …}}` line of one file to `(key, bytes)`, streamed (other modes:
    `{"key": …, "instance" or "example": …}` lines, see serving/batch_prediction/any_model.py)."""
    number = 0
    try:
        with open_input(path) as f:
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    yield _json_record(f"{path}:{number}", raw, mode)
    except (OSError, EOFError, zlib.error) as e:  # a compressed file cut short or corrupt too
        yield Failure(f"{path}:{number + 1}", "UNAVAILABLE", f"cannot read the file past line {number}: {e}")


# --- the model ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What the job needs to know about a model before any worker loads it."""

    path: str
    height: int
    width: int
    class_names: tuple[str, ...]
    signature: str = SIGNATURE
    mode: str = IMAGES


def version_name(version_dir: str) -> str:
    """`<model>/<version>`, the last two parts of a version folder: a copy of the folder keeps them, so that the
    servable's name and version stay as the driver sees them."""
    parts = version_dir.rstrip("/").split("/")
    return "/".join(p for p in parts[-2:] if p)


def resolve_model(model_dir: str) -> str:
    """The version folder a --model_dir names: itself when it holds a SavedModel, else its base path's highest
    published version (TF Serving's latest policy); on a store, read off one listing."""
    if not storage.is_remote(model_dir):
        return latest_version(model_dir)
    files = storage.list_files(model_dir)
    base = model_dir.rstrip("/")
    if any(name in files for name in SAVED_MODEL_FILES):
        return base
    versions = versions_in_listing(base, files)
    if not versions:
        raise FileNotFoundError(f"no SavedModel in {model_dir!r}: of its {len(files)} files none is a saved_model.pb, "
                                "nor in an integer version folder")
    return storage.join(base, versions[max(versions)])


_model_copies: dict[tuple, str] = {}
_copying = threading.Lock()


def model_folder(path: str, parent: str | None = None) -> str:
    """A local folder holding the version at `path`: a local one as it is; a URL's files downloaded through the
    storage layer once per process (again if they changed), into `parent` (the temporary folder by default),
    as `<model>/<version>` there. Every Beam worker and Spark executor process fetches its own copy, as it reads
    the inputs, so the model needs no shared disk and no copy from the driver."""
    if not storage.is_remote(path):
        return path
    files = storage.list_files(path)
    key = (path, tuple(sorted((name, entry.size, entry.tag) for name, entry in files.items())))
    with _copying:
        if key not in _model_copies:
            if not any(name in files for name in SAVED_MODEL_FILES):
                raise FileNotFoundError(f"no SavedModel in {path!r}")
            top = tempfile.mkdtemp(prefix="petal-model-", dir=parent and os.path.abspath(parent))
            atexit.register(shutil.rmtree, top, True)
            folder = os.path.join(top, *version_name(path).split("/"))
            started = time.monotonic()
            storage.download(path, files, folder)
            logger.info("model downloaded", extra={"fields": {
                "model": path, "folder": folder, "bytes": sum(entry.size for entry in files.values()),
                "seconds": round(time.monotonic() - started, 2)}})
            _model_copies[key] = folder
        return _model_copies[key]


def read_model_info(model_dir: str, signature_name: str | None = None, method: str | None = None,
                    input_format: str | None = None) -> ModelInfo:
    """What runs, without loading the graph: a Petal image classifier's image size (from its `predict_images`
    input spec) and labels, unless a signature or method is named or there is no `predict_images`; then the
    signature (serving_default by default) and whether it predicts, classifies or regresses. The info's path
    is the version folder as given (a URL stays one); its files are read from model_folder's copy."""
    path = resolve_model(model_dir)
    folder = model_folder(path)
    signatures = read_signatures(folder)
    if SIGNATURE not in signatures or signature_name not in (None, SIGNATURE) or method is not None:
        return _any_model_info(path, folder, signatures, signature_name or DEFAULT_SIGNATURE, method, input_format)
    dims = signatures[SIGNATURE].inputs[SIGNATURE_INPUT].shape or []
    if len(dims) != 4 or dims[1] <= 0 or dims[2] <= 0:
        raise ValueError(f"{path}: {SIGNATURE} input must be [batch, H, W, 3] with static H and W, got {dims}")
    class_names = tuple(read_labels(f"{folder}/{LABELS_ASSET}"))
    return ModelInfo(path=path, height=dims[1], width=dims[2], class_names=class_names)


def _any_model_info(path: str, folder: str, signatures: dict, signature_name: str, method: str | None,
                    input_format: str | None) -> ModelInfo:
    from serving.batch_prediction import any_model

    if signature_name not in signatures:
        raise ValueError(f"{path} has no {signature_name!r} signature (has {sorted(signatures)})")
    mode = any_model.choose_method(signature_name, signatures[signature_name], method)
    if input_format is not None and input_format not in any_model.INPUT_FORMATS[mode]:
        raise ValueError(f"signature {signature_name!r} runs {mode}, which reads --input_format "
                         f"{' or '.join(any_model.INPUT_FORMATS[mode])}, not {input_format}")
    return ModelInfo(path=path, height=0, width=0, class_names=tuple(class_names(folder)), signature=signature_name,
                     mode=mode)


def select_strategy(use_tpu: bool, tpu: str | None = None) -> tf.distribute.Strategy:
    """TPUStrategy when asked for, MirroredStrategy over several GPUs (or several logical CPUs, which only exist
    when configured on purpose), else the default strategy.

    Not training's resolve_strategy: a batch job on a worker must not turn a TF_CONFIG it happens to inherit
    into MultiWorkerMirroredStrategy, logical CPU devices must count as replicas, and serving code never imports
    training beyond the shared preprocessing.
    """
    if use_tpu:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "local")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    for kind in ("GPU", "CPU"):
        devices = tf.config.list_logical_devices(kind)
        if len(devices) > 1:
            return tf.distribute.MirroredStrategy([d.name for d in devices])
    return tf.distribute.get_strategy()


class StaticBatchClassifier:
    """`predict_images` compiled for exactly one input shape, [batch_size, H, W, 3], split across replicas.

    A batch of the wrong size is a TF shape error, not a silent recompile, so the static-shape promise is
    enforced rather than hoped for.
    """

    def __init__(self, info: ModelInfo, batch_size: int, use_tpu: bool = False, tpu: str | None = None):
        self.strategy = select_strategy(use_tpu, tpu)
        self.replicas = self.strategy.num_replicas_in_sync
        if batch_size % self.replicas:
            raise ValueError(f"--batch_size {batch_size} is not a multiple of the {self.replicas} replicas")
        self.batch_size = batch_size
        self.class_names = np.array(info.class_names, dtype=object)
        with self.strategy.scope():
            self._loaded = tf.saved_model.load(model_folder(info.path))
        signature = self._loaded.signatures[SIGNATURE]
        strategy, replicas = self.strategy, self.replicas

        @tf.function(input_signature=[tf.TensorSpec([batch_size, info.height, info.width, 3], tf.float32)])
        def step(images):
            shards = tf.split(images, replicas)
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx: shards[ctx.replica_id_in_sync_group])
            outputs = strategy.run(
                lambda x: {k: v for k, v in signature(images=x).items() if k in DEVICE_OUTPUTS},
                args=(per_replica,))
            return {k: tf.concat(strategy.experimental_local_results(v), axis=0) for k, v in outputs.items()}

        self._step = step
        logger.info("model loaded", extra={"fields": {
            "model": info.path, "strategy": type(self.strategy).__name__, "replicas": self.replicas,
            "batch_size": batch_size}})

    def predict(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """Up to batch_size images in, as many rows out: zero rows pad the batch and are cut off again."""
        rows = len(images)
        if not 0 < rows <= self.batch_size:
            raise ValueError(f"got {rows} rows for a static batch of {self.batch_size}")
        padded = np.zeros((self.batch_size, *images.shape[1:]), np.float32)
        padded[:rows] = images
        outputs = {k: v.numpy()[:rows] for k, v in self._step(padded).items()}
        outputs["class"] = self.class_names[outputs["classid"]]
        return outputs

    def predict_rows(self, images: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
        outputs = self.predict(np.stack(images))
        return [{k: v[i] for k, v in outputs.items()} for i in range(len(images))]


class BatchModel(Protocol):
    """What both engines run: StaticBatchClassifier, or any_model.SignatureBatchModel for any other SavedModel."""

    batch_size: int

    def predict_rows(self, rows: Sequence[Any]) -> list[Any]: ...


def load_model(info: ModelInfo, batch_size: int, use_tpu: bool = False, tpu: str | None = None) -> BatchModel:
    """The image classifier on its static batches, or any other SavedModel's signature through the server's
    Servable (which runs on the default device: TPUStrategy is for the image path only)."""
    if info.mode == IMAGES:
        return StaticBatchClassifier(info, batch_size, use_tpu, tpu)
    if use_tpu:
        raise ValueError("--use_tpu runs only Petal's image classifiers (their predict_images signature)")
    from serving.batch_prediction import any_model

    return any_model.SignatureBatchModel(model_folder(info.path), info.signature, info.mode, batch_size)


def check_model(info: ModelInfo) -> None:
    """Loads the model and checks the signature the job runs, on the default device, and lets it go again: what
    the driver does before any worker starts (serving/batch_prediction/preflight.py). An image classifier's
    `predict_images` must take `images` and give the outputs the job reads; any other model loads as the server
    loads it."""
    if info.mode != IMAGES:
        load_model(info, 1)
        return
    signature = tf.saved_model.load(model_folder(info.path)).signatures[SIGNATURE]
    takes = set(signature.structured_input_signature[1])
    gives = set(signature.structured_outputs)
    if takes != {SIGNATURE_INPUT} or not gives >= set(DEVICE_OUTPUTS):
        raise ValueError(f"{SIGNATURE} takes {sorted(takes)} and gives {sorted(gives)}; the job needs "
                         f"{SIGNATURE_INPUT!r} in and {', '.join(DEVICE_OUTPUTS)} out")


def predict_batch(model: BatchModel, rows: Sequence[Any]) -> list[Any]:
    """The one place a batch job runs a signature: up to batch_size decoded rows to one prediction each (for
    any other SavedModel, its REST JSON answer or the any_model.RowError its row failed with).

    Both engines call this, so every kind of model only has to offer `predict_rows`. (Not an isinstance test:
    Beam may hand over a proxy to a model shared between processes.)
    """
    return model.predict_rows(rows)


def row_bytes(row: Any) -> int:
    """A decoded row's size, for the engines' batching statistics."""
    if isinstance(row, bytes):
        return len(row)
    if isinstance(row, dict):
        return sum(value.nbytes for value in row.values())
    return row.nbytes


# --- decoding, formatting, and a stream of records end to end -----------------------------------------------

class PayloadDecoder:
    """`(key, payload)` to `(key, row)` for any other SavedModel, with the signature read from saved_model.pb."""

    def __init__(self, info: ModelInfo):
        from serving.batch_prediction import any_model

        self._decode = any_model.RowDecoder(info.mode, read_signatures(model_folder(info.path))[info.signature])

    def __call__(self, key: Any, payload: Any) -> tuple[Any, Any] | Failure:
        try:
            return key, self._decode(payload)
        except ServingError as error:
            return Failure.of(key, error)

class ImageDecoder:
    """`(key, bytes)` to `(key, float32 [H, W, 3] in [-1, 1])`, on the host, exactly as the server does it.

    An image whose header claims more than `max_pixels` becomes an error row before anything decodes it, as the
    server refuses it: a few KB of decompression bomb would otherwise take gigabytes in a worker, and the worker's
    death takes every record of its bundle or partition with it."""

    def __init__(self, height: int, width: int, max_pixels: int):
        self._max_pixels = max_pixels
        self._decode = tf.function(lambda data: preprocess_eval(data, height, width),
                                   input_signature=[tf.TensorSpec([], tf.string)])

    def __call__(self, key: Any, data: bytes) -> tuple[Any, np.ndarray] | Failure:
        try:
            check_pixels(np.array([data], dtype=object), self._max_pixels)
            return key, self._decode(data).numpy()
        except ServingError as error:
            return Failure.of(key, error)
        except tf.errors.InvalidArgumentError as e:
            return Failure(key, "INVALID_ARGUMENT", f"cannot decode image: {op_error_message(e.message)}")


def make_decoder(info: ModelInfo, max_image_pixels: int) -> ImageDecoder | PayloadDecoder:
    return ImageDecoder(info.height, info.width, max_image_pixels) if info.mode == IMAGES else PayloadDecoder(info)


def prediction_row(key: Any, prediction: dict[str, np.ndarray], class_names: tuple[str, ...], top_k: int) -> dict:
    """One results line; `top_k` adds the best labels in the classify_image response's shape."""
    probabilities = prediction["probabilities"]
    row = {"class": str(prediction["class"]), "classid": int(prediction["classid"]),
           "probabilities": probabilities.tolist()}
    if top_k:
        best = np.argsort(-probabilities, kind="stable")[:top_k]
        row["top_k"] = [{"label": class_names[i], "score": float(probabilities[i])} for i in best]
    return {"key": key, "prediction": row}


def result_line(key: Any, prediction: Any, info: ModelInfo, top_k: int) -> tuple[bool, str]:
    """One prediction as `(is_result, json_line)`: a row the model refused is an error line like any other."""
    if info.mode == IMAGES:
        return True, json.dumps(prediction_row(key, prediction, info.class_names, top_k))
    from serving.batch_prediction import any_model

    if isinstance(prediction, any_model.RowError):
        return False, Failure(key, prediction.status, prediction.message).to_json()
    return True, json.dumps({"key": key, any_model.RESULT_FIELD[info.mode]: prediction})


@dataclass
class Counts:
    """What one stream of records produced; the engines add these up across workers."""

    read: int = 0
    predicted: int = 0
    failed: int = 0
    batches: int = 0
    padded: int = 0

    def add(self, other: Counts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Scorer:
    """Records or failures in, `(is_result, json_line)` out, `batch_size` decoded rows per model call.

    Memory stays at one batch of decoded rows whatever the stream's length, since lines leave as soon as
    their batch is done.
    """

    decoder: ImageDecoder | PayloadDecoder
    model: BatchModel
    info: ModelInfo
    top_k: int
    counts: Counts = field(default_factory=Counts)

    def score(self, items: Iterable[Record | Failure]) -> Iterator[tuple[bool, str]]:
        pending: list[tuple[Any, Any]] = []
        for item in items:
            self.counts.read += 1
            decoded = item if isinstance(item, Failure) else self.decoder(*item)
            if isinstance(decoded, Failure):
                self.counts.failed += 1
                yield False, decoded.to_json()
                continue
            pending.append(decoded)
            if len(pending) == self.model.batch_size:
                yield from self._flush(pending)
                pending = []
        if pending:
            yield from self._flush(pending)

    def _flush(self, pending: list[tuple[Any, Any]]) -> Iterator[tuple[bool, str]]:
        predictions = predict_batch(self.model, [row for _, row in pending])
        self.counts.batches += 1
        self.counts.padded += self.model.batch_size - len(pending)
        for (key, _), prediction in zip(pending, predictions, strict=True):
            is_result, line = result_line(key, prediction, self.info, self.top_k)
            if is_result:
                self.counts.predicted += 1
            else:
                self.counts.failed += 1
            yield is_result, line


# --- the job around the records -----------------------------------------------------------------------------

def move(source: str, target: str) -> None:
    """A finished file to its final name, replacing what is there: a rename on a disk, a copy and a delete on an
    object store, whose objects appear whole; either way no reader sees half a shard."""
    try:
        storage.filesystem(target).mv(source, target)
    except Exception as error:  # every store's SDK has its own errors
        raise storage.StorageError(f"could not move {source} to {target}: {storage.describe(error)}") from None


def remove(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            storage.filesystem(path).rm_file(path)
        except Exception as error:  # every store's SDK has its own errors
            raise storage.StorageError(f"could not delete {path}: {storage.describe(error)}") from None


def join_files(parts: Sequence[str], target: str) -> None:
    """The parts' lines, in their order, as one file (written beside it, then moved into place)."""
    staging = f"{target}.tmp"
    with storage.open_file(staging, "wb") as out:
        for part in parts:
            with storage.open_file(part) as f:
                shutil.copyfileobj(f, out)
    move(staging, target)


def commit_shards(parts: Sequence[str], output_dir: str, prefix: str) -> None:
    """Finished parts as `<prefix>-<index>-of-<count>` shards, in their order; one empty shard when there is no
    part, so that a job without results still says so in a file."""
    if not parts:
        with storage.open_file(storage.join(output_dir, f"{prefix}-00000-of-00001"), "wb"):
            return
    for index, part in enumerate(parts):
        move(part, storage.join(output_dir, f"{prefix}-{index:05d}-of-{len(parts):05d}"))


def prepare_output_dir(output_dir: str, overwrite: bool) -> None:
    """Never mix two runs' shards: refuse a folder that holds any file, or with --overwrite delete an earlier run's
    shards and unfinished parts (the folder's other files stay)."""
    existing = storage.list_files(output_dir)
    if not existing:
        return
    if not overwrite:
        files = f"{len(existing)} file{'s' if len(existing) > 1 else ''}"
        raise FileExistsError(f"--output_dir {output_dir} is not empty ({files}); choose a new directory or pass "
                              "--overwrite")
    remove(storage.join(output_dir, name) for name in existing
           if name.startswith((RESULTS_PREFIX, ERRORS_PREFIX)) and "/" not in name)
    storage.remove_tree(storage.join(output_dir, TEMPORARY))


def summary(info: ModelInfo, output_dir: str, counts: Counts, seconds: float, processing: float,
            verified: bool = True, **extra: Any) -> dict[str, Any]:
    """The job's summary line, the same for both engines; `complete` says rows in = results + errors, and that
    whatever else the engine `verified` about its outputs held."""
    return {"model": info.path, "output_dir": output_dir, "rows_in": counts.read, "results": counts.predicted,
            "errors": counts.failed, "complete": verified and counts.read == counts.predicted + counts.failed,
            "batches": counts.batches, "padding_rows": counts.padded, "seconds": round(seconds, 2),
            "processing_seconds": round(processing, 2),
            "images_per_s": round(counts.predicted / processing, 1) if processing else 0.0, **extra}


def report(job_summary: dict[str, Any]) -> int:
    """Prints the summary; a job whose outputs do not add up to its inputs fails loudly, with exit code 1."""
    print(json.dumps(job_summary))
    if not job_summary["complete"]:
        logger.error("rows lost: rows in != results + errors", extra={"fields": job_summary})
        return 1
    return 0
