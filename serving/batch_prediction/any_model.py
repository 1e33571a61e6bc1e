"""Any SavedModel in a batch job: one signature run on static padded batches through the server's own Servable.

The server's runtimes (serving/core/runtimes.py: TF2 functions, a TF1 Session by tensor names) load the model, so a
batch job runs whatever `petal serve` serves, and its answers are written as the server's REST API writes them:

- Predict, for a signature on named tensors. A JSON line is one row, `{"key": K, "instance": V}`, where V is one
  element of a TF Serving REST `"instances"` list (an object keyed by input name, or a bare value when the
  signature has one input; bytes as `{"b64": ...}`), which is also one line of a Vertex AI batch prediction JSONL
  input. The result line holds that row's element of the REST `"predictions"`.
- Classify and Regress, for a signature over serialized tf.Examples: TFRecords of tf.Example, fed as they are,
  or JSON lines `{"key": K, "example": {feature: value, ...}}` with one element of a REST `"examples"` list. The
  result line holds the row's element of the REST `"results"`: `[[label, score], ...]`, or the regression value.

The mode follows from the signature: its method name when that is classify or regress, else its structure by TF
Serving's rules (serving/core/examples.py: one DT_STRING input `inputs`, and `classes`/`scores`, or `outputs`),
else Predict; `--method` overrides it. Every batch is `batch_size` rows: the last real row repeats into the
padding (a zero row may not even parse as the model's input) and the padding is cut off again. A batch that
fails is run again row by row, so one bad record is one error line and its neighbours still get their answers.
No Beam or Spark here: serving/batch_prediction/steps.py calls this for both engines.
"""
from __future__ import annotations

import logging
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exported_models.model_format import SignatureInfo
from serving.core import Servable, ServingError, check_shape, coerce, examples, invalid
from serving.protocols.codec.tfserving_json import (
    example_input,
    instance_tensors,
    predict_response,
    results_response,
)

logger = logging.getLogger(__name__)

PREDICT, CLASSIFY, REGRESS = "predict", "classify", "regress"
METHODS = (PREDICT, CLASSIFY, REGRESS)
_TF_METHODS = {CLASSIFY: examples.CLASSIFY_METHOD, REGRESS: examples.REGRESS_METHOD}
# The input formats each mode reads: Predict needs named tensors, which only JSON lines carry.
INPUT_FORMATS = {PREDICT: ("jsonl",), CLASSIFY: ("tfrecord", "jsonl"), REGRESS: ("tfrecord", "jsonl")}
RESULT_FIELD = {PREDICT: "prediction", CLASSIFY: "result", REGRESS: "result"}

Row = Any  # Predict: {input name: [1, ...] array}; Classify and Regress: one serialized tf.Example


@dataclass(frozen=True)
class RowError:
    """Why the model refused one row: a plain value, because Beam may return answers from a model shared between
    processes by pickling them (a ServingError does not pickle)."""

    status: str
    message: str


def _takes_examples(info: SignatureInfo) -> bool:
    return list(info.inputs) == [examples.INPUTS] and info.inputs[examples.INPUTS].dtype == "DT_STRING"


def choose_method(signature_name: str, info: SignatureInfo, method: str | None) -> str:
    """Predict, Classify or Regress for this signature; a classify or regress signature that breaks TF Serving's
    rules is refused before any worker starts."""
    if method is None:
        method = next((mode for mode, name in _TF_METHODS.items() if info.method_name == name), None)
    if method is None and _takes_examples(info):
        for mode, name in _TF_METHODS.items():
            try:
                examples.check_signature(name, info)
            except ServingError:
                continue
            return mode
    if method in _TF_METHODS:
        try:
            examples.check_signature(_TF_METHODS[method], info)
        except ServingError as error:
            raise ValueError(f"signature {signature_name!r} cannot {method}: {error.message}") from None
    return method or PREDICT


def record_payload(method: str, row: dict) -> Any:
    """A JSON line's payload for `method`: the instance as it is (RowDecoder reads it with the signature), or the
    example serialized; ServingError (INVALID_ARGUMENT) for a line that has neither."""
    if method == PREDICT:
        if "instance" not in row:
            raise invalid('line must be a JSON object with "key" and "instance" (one TF Serving REST instance)')
        return row["instance"]
    if "example" not in row:
        raise invalid('line must be a JSON object with "key" and "example" (one TF Serving REST example)')
    return examples.serialized_examples(example_input(row["example"]))[0]


class RowDecoder:
    """A record's payload to the row the model takes: a Predict instance to its tensors in the signature's dtypes,
    on the host; a serialized tf.Example stays as it is. Shapes are checked with the model loaded (only where it
    runs as TF2 functions, as in the server: SignatureBatchModel)."""

    def __init__(self, method: str, info: SignatureInfo):
        self._method = method
        self._info = info
        self._required = set(info.inputs) - set(info.defaults)

    def __call__(self, payload: Any) -> Row:
        if self._method != PREDICT:
            return payload
        inputs = self._info.inputs
        named = instance_tensors(payload, self._info)
        unknown = sorted(set(named) - inputs.keys())
        missing = sorted(self._required - set(named))
        if unknown or missing:
            raise invalid(f"instance has inputs {sorted(named)}, the signature takes {sorted(inputs)}")
        return {name: coerce(name, value, inputs[name], static_shapes=False) for name, value in named.items()}


def folder_version(path: str) -> int:
    """The version a folder's name says (0 for a model folder that is not a numbered version)."""
    name = posixpath.basename(path.rstrip("/"))
    return int(name) if name.isdigit() else 0


class SignatureBatchModel:
    """One signature of any servable model, on batches of exactly `batch_size` rows."""

    def __init__(self, path: str, signature_name: str, method: str, batch_size: int):
        self.servable = Servable(posixpath.basename(posixpath.dirname(path.rstrip("/"))), folder_version(path), path)
        self.signature_name = signature_name
        self.method = method
        self.batch_size = batch_size
        logger.info("model loaded", extra={"fields": {
            "model": path, "format": self.servable.format, "signature": signature_name, "method": method,
            "batch_size": batch_size}})

    def predict_rows(self, rows: Sequence[Row]) -> list[Any]:
        """Up to batch_size rows to one answer each: its REST JSON value, or the RowError it failed with."""
        if not 0 < len(rows) <= self.batch_size:
            raise ValueError(f"got {len(rows)} rows for a static batch of {self.batch_size}")
        try:
            return self._run(rows)
        except ServingError as error:
            if len(rows) == 1:
                return [RowError(error.code.name, error.message)]
        return [self.predict_rows([row])[0] for row in rows]

    def _run(self, rows: Sequence[Row]) -> list[Any]:
        padded = list(rows) + [rows[-1]] * (self.batch_size - len(rows))
        if self.method != PREDICT:
            outputs = self.servable.run(self.signature_name, {examples.INPUTS: np.array(padded, dtype=object)})
            if self.method == CLASSIFY:
                return results_response(examples.Result(self.method, self.signature_name, classifications=(
                    examples.classifications(outputs, self.batch_size)[:len(rows)])))
            return results_response(examples.Result(self.method, self.signature_name, regressions=(
                examples.regressions(outputs, self.batch_size)[:len(rows)])))
        if self.servable.static_shapes:  # as the server checks a TF2 signature's shapes, here row by row
            signature = self.servable.signatures[self.signature_name]
            for row in rows:
                for name, value in row.items():  # converted by RowDecoder already: only the shape is left
                    check_shape(name, value, signature.inputs[name])
        try:
            inputs = {name: np.concatenate([row[name] for row in padded]) for name in padded[0]}
        except (KeyError, ValueError) as error:  # rows of other inputs or shapes: each one runs alone
            raise invalid(f"rows do not stack into one batch: {error}") from None
        outputs = self.servable.run(self.signature_name, inputs)
        unbatched = sorted(k for k, v in outputs.items() if v.ndim == 0 or v.shape[0] != self.batch_size)
        if unbatched:
            raise invalid(f"outputs {unbatched} are not batched, so they cannot be split into one answer per row")
        return predict_response({k: v[:len(rows)] for k, v in outputs.items()}, row_format=True)["predictions"]
