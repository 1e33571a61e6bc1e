"""Which runtime a version folder runs in, and how it becomes something that runs signatures there, the way TF
Serving's SavedModelBundle loads it. (TF Serving's Loader, which the repository is given, is serving/core/servable.py's
`loader`, over this module.)

- A TF2 SavedModel (one meta graph with an object graph, as `tf.saved_model.save` and Keras write) runs in a
  Session too, as TF Serving runs it, when its graph stands alone: every signature tensor dense and every variable
  restored by the graph's own restore op. A call then costs about 0.35 ms less CPU than the function call
  (docs/performance.md, 'TF2 models in a Session'). Otherwise (a Keras 3 model whose checkpoint holds copies of its
  variables, keras-team/keras#20096, or ragged and sparse tensors) it loads with `tf.saved_model.load` and its
  signatures are called as functions. Either way the dataplane checks the signatures' shapes.
- Any other SavedModel (a TF1 graph: Estimator exports, `tf.compat.v1.saved_model.Builder`) loads into a
  `tf.compat.v1.Session` on its own graph: the meta graph with the configured tags, its assets, and its main op or
  legacy init op run at load. Signatures run by tensor name, so only the graph's own ops check shapes.
- With --prefer_tflite_model, a folder holding `model.tflite` runs on TensorFlow's TFLite interpreter
  (serving/core/tflite.py).

TensorFlow's errors keep their code: bad input is never INTERNAL.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, error_codes_pb2
from tensorflow.python.util import deprecation

from exported_models import model_format
from exported_models.model_format import SignatureInfo
from serving import threads
from serving.core.errors import Code, ServingError, failed_to_load, invalid, op_error_message

DEFAULT_TAGS = frozenset({"serve"})


@dataclass(frozen=True)
class LoadOptions:
    tags: frozenset[str] = DEFAULT_TAGS
    prefer_tflite: bool = False
    batching: bool = False  # decide at load which signatures batch (serving/core/batchable.py)

    @classmethod
    def from_flags(cls, saved_model_tags: str, prefer_tflite_model: bool, enable_batching: bool = False) -> LoadOptions:
        """--saved_model_tags is comma-separated, empty parts skipped; none at all means "serve", as in TF Serving."""
        tags = frozenset(tag.strip() for tag in saved_model_tags.split(",") if tag.strip())
        return cls(tags or DEFAULT_TAGS, prefer_tflite_model, enable_batching)


class RuntimeModel(Protocol):
    """A version loaded into one of the runtimes (`FunctionModel`, `SessionModel`, TFLite's `TfLiteModel`), as the
    servable runs it: `run` fetches only `output_names` (aliases of the signature).
    `metadata` is the SavedModel's whole signature_def map, as TF Serving's metadata lists it."""
    format: str
    signatures: dict[str, SignatureInfo]
    metadata: dict[str, SignatureInfo]
    static_shapes: bool

    def run(self, key: str, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]: ...


def status_error(error: tf.errors.OpError) -> ServingError:
    """TensorFlow's error codes are the status codes, so the code carries over as it is."""
    code = Code[error_codes_pb2.Code.Name(error.error_code)]
    return ServingError(code, op_error_message(error.message) or str(error))


def load_error(error: Exception) -> ServingError:
    """What a failed load reports (serving/core/repository.py `load_failure`): a TensorFlow error keeps its own code
    and message, as TF Serving keeps its loader's status (a corrupt variables.index is DATA_LOSS, a missing
    saved_model.pb NOT_FOUND); anything else is Petal's (`failed_to_load`)."""
    return status_error(error) if isinstance(error, tf.errors.OpError) else failed_to_load(error)


_pool_high_water = 0  # the pool's peak since the process started, which its own peak forgets when reset


def tensor_pool() -> tuple[int, int] | None:
    """Bytes in use and at the peak in TensorFlow's CPU tensor pool, whose peak then starts again from what is in use;
    None where TensorFlow's allocator is its default one, which keeps no count (serving/host/memory.py's
    `pool_tensors` chooses the pool)."""
    try:
        info = tf.config.experimental.get_memory_info("CPU:0")
        tf.config.experimental.reset_memory_stats("CPU:0")
    except ValueError:
        return None
    global _pool_high_water
    _pool_high_water = max(_pool_high_water, info["peak"])
    return info["current"], info["peak"]


def pooled_bytes() -> int:
    """What the tensor pool holds free: the most it ever held in use less what it holds now. The pool gives nothing
    back, so every byte it once held stays resident for the next tensors (0 without the pool)."""
    counts = tensor_pool()
    return 0 if counts is None else max(0, _pool_high_water - counts[0])


def load(path: str, options: LoadOptions) -> RuntimeModel:
    if options.prefer_tflite and os.path.exists(os.path.join(path, model_format.TFLITE_FILE)):
        from serving.core.tflite import TfLiteModel  # only TFLite servers pay for the interpreter's import

        return TfLiteModel(os.path.join(path, model_format.TFLITE_FILE))
    saved_model = model_format.read_saved_model(path)
    graph = model_format.meta_graph(saved_model, set(options.tags))
    if len(saved_model.meta_graphs) == 1 and graph.HasField("object_graph_def"):  # tf.saved_model.load's test
        return SessionModel.of_tf2(path, graph, options.tags) or FunctionModel(path, graph, options.tags)
    return SessionModel(path, options.tags)


@contextlib.contextmanager
def _tf_errors() -> Iterator[None]:
    """A model call's TensorFlow errors as TF Serving answers them: a failed op by its status, a refused feed (wrong
    dtype, shape or structure) as INVALID_ARGUMENT with the first line of TensorFlow's text."""
    try:
        yield
    except tf.errors.OpError as error:
        raise status_error(error) from None
    except (TypeError, ValueError) as error:
        raise invalid(str(error).splitlines()[0]) from None


class FunctionModel:
    """A TF2 SavedModel's signatures as the concrete functions `tf.saved_model.load` restores, each called flat
    (`_FlatCall`)."""
    format = "saved_model_tf2"
    static_shapes = True

    def __init__(self, path: str, graph, tags: frozenset[str]):
        self._loaded = tf.saved_model.load(path, tags=sorted(tags))
        self.metadata = model_format.signature_infos(graph, internal=True)
        self.signatures = {key: info for key, info in model_format.callable_signatures(self.metadata).items()
                           if key in self._loaded.signatures}
        self._calls = {key: _FlatCall(self._loaded.signatures[key]) for key in self.signatures}

    def run(self, key: str, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        return self._calls[key](inputs, output_names)


class _FlatCall:
    """One signature's concrete function called the way its structured `__call__` ends up calling it: its
    inference function on the input tensors in the function's order followed by the captured variables, with the
    order of both inputs and outputs and the captures worked out once instead of on every call (the structured
    call binds the keyword arguments to the function type, flattens the captures and checks for gradient tapes
    and distribution strategies each time: about 50 us a call).

    The checks that matter stay as they were: an input missing or unknown is INVALID_ARGUMENT here, as the
    structured call's TypeError was, and a tensor of another dtype is refused by TensorFlow's runtime with the
    same InvalidArgumentError either way. Neither call checks shapes; the dataplane does (dataplane.check_shape).
    """

    def __init__(self, fn) -> None:
        self._fn = fn.inference_fn
        self._input_names = list(fn.function_type.parameters)  # the flat inputs' order
        self._captures = fn.captured_inputs  # the variables' handles, fixed once the model is loaded
        # the flat outputs' order, one per output, unless an output is a composite tensor (several each)
        names = tf.nest.flatten({name: name for name in fn.structured_outputs})
        self._output_names = names if len(names) == len(self._fn.function_type.flat_outputs) else None

    def __call__(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        if len(inputs) != len(self._input_names) or not all(name in inputs for name in self._input_names):
            raise invalid(f"The signature takes the inputs {sorted(self._input_names)}; got {sorted(inputs)}")
        with _tf_errors():
            flat = self._fn.call_flat(*(tf.constant(inputs[name]) for name in self._input_names), *self._captures)
        outputs = dict(zip(self._output_names, flat, strict=True)) if self._output_names is not None \
            else self._fn.function_type.pack_output(flat)
        return {k: outputs[k].numpy() for k in output_names}


class SessionModel:
    """A TF1 SavedModel in a Session of its own, as TF Serving's SavedModelBundle holds it.

    The Session takes its thread counts from TensorFlow's context, which serving/process/tensorflow_runtime.py sets for
    TF2 models too, and runs on the inter-op pool that every Session shares, which that module starts niced. Each
    (signature, outputs) pair gets one callable of the C++ Session (`Session::MakeCallable` from CallableOptions
    that name the feed and fetch tensors), which feeds by tensor name as TF Serving's `Session::Run` does: a fed
    value replaces its tensor whatever the tensor's static shape, and only the graph's own ops check shapes.
    `Session.make_callable` would not do: given feeds, it goes through `Session.run` and its Python feed checks.

    A call from a thread that serves the worker's only request in flight (`threads.alone`: the gevent worker's
    event loop serving one connection, or a gRPC thread whose call is the only one) runs the graph on that thread,
    which would only wait for the pool meanwhile (RunOptions.inter_op_thread_pool -1): at concurrency 1 that took
    a REST request's thread switches from about 9.7 to 0.8, a gRPC call's from 29.8 to 18.3 (docs/performance.md,
    'TF2 models in a Session'). Every other call keeps the niced pool: run on their callers' threads, batches
    competed at normal priority with the threads that read requests (concurrency 16 lost 20–31% of its REST
    throughput), and so did gRPC calls that merely found a batch slot free (0.84x at 64).
    """
    format = "saved_model_session"
    static_shapes = False

    def __init__(self, path: str, tags: frozenset[str]):
        self._session = tf.compat.v1.Session(graph=tf.Graph())
        with deprecation.silence():  # TF's notice that the TF1 loader is deprecated would print at every load
            graph = tf.compat.v1.saved_model.load(self._session, sorted(tags), path)
        self.metadata = model_format.signature_infos(graph, internal=True)
        self.signatures = model_format.callable_signatures(self.metadata)
        self._callables: dict[tuple[str, tuple[str, ...], bool], Callable[..., list[np.ndarray]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def of_tf2(cls, path: str, graph, tags: frozenset[str]) -> SessionModel | None:
        """A TF2 SavedModel in a Session, if its graph runs on its own (the module docstring); None if not. Its
        signatures keep TF2's contract: the dataplane checks their shapes."""
        signatures = model_format.signature_infos(graph)
        if not all(tensor.name for info in signatures.values()
                   for tensor in (*info.inputs.values(), *info.outputs.values())):
            return None  # a composite tensor has no single tensor to feed or fetch
        model = cls(path, tags)
        if not model._variables_restored():
            model._session.close()
            return None
        model.format, model.static_shapes = "saved_model_tf2_session", True
        return model

    def _variables_restored(self) -> bool:
        graph = self._session.graph
        handles = [op.outputs[0] for op in graph.get_operations() if op.type == "VarHandleOp"]
        if not handles:
            return True
        with graph.as_default():
            restored = tf.reduce_all([tf.raw_ops.VarIsInitializedOp(resource=handle) for handle in handles])
        return bool(self._session.run(restored))

    def run(self, key: str, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        info = self.signatures[key]
        feeds = sorted(info.inputs)
        missing = sorted(set(feeds) - set(inputs))
        if missing:
            raise invalid(f"Signature {key!r} needs the inputs {missing}")
        with _tf_errors():  # a signature of sparse or ragged tensors has no tensor names to run by: bad input too
            run = self._callable(key, tuple(output_names), threads.alone())
            values = run(*(inputs[name] for name in feeds))
        return dict(zip(output_names, values, strict=True))

    def _callable(self, key: str, output_names: tuple[str, ...], inline: bool) -> Callable[..., list[np.ndarray]]:
        run = self._callables.get((key, output_names, inline))  # built once: later calls take it without the lock
        if run is not None:
            return run
        with self._lock:
            run = self._callables.get((key, output_names, inline))
            if run is None:
                info = self.signatures[key]
                options = config_pb2.CallableOptions(
                    feed=[info.inputs[name].name for name in sorted(info.inputs)],
                    fetch=[info.outputs[name].name for name in output_names])
                if inline:
                    options.run_options.inter_op_thread_pool = -1  # TensorFlow's value for the calling thread
                run = self._session._make_callable_from_options(options)  # the C API's callable; no public name
                self._callables[(key, output_names, inline)] = run
            return run
