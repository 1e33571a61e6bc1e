"""One serving worker process: how TensorFlow runs in it (threads, spin-waits, GPU memory), its DataPlane, and the
watch on --model_config_file.

The gunicorn app (serving/server.py) calls `create_core` once per worker after the fork; everything that needs the
worker's core later (gRPC, signal handlers) asks `current()`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading

import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context
from tensorflow_serving.config import model_server_config_pb2

from serving.config import (
    DataPlaneOptions,
    ServerOptions,
    budget_after_load,
    measures_memory_budget,
    read_model_config,
    resolve_memory_budget,
)
from serving.core import DataPlane, ServingError
from serving.cpus import available_cores

logger = logging.getLogger(__name__)

RELOAD_FILE = "model_config.pbtxt"
RELOAD_POLL_S = 0.5

_current: DataPlane | None = None


def current() -> DataPlane:
    """This process's core (created by `create_core` in the gunicorn worker)."""
    if _current is None:
        raise RuntimeError("no serving core in this process; call create_core first")
    return _current


def intra_op_threads(options: ServerOptions, cores: int) -> int:
    """Split the cores between everything that runs the model at once: each worker's batch threads (or, without
    batching, the worker itself). A pool per caller as large as the machine only spins: for the default model,
    one intra-op thread per batch thread gives 1.2-1.3x the images/s of TensorFlow's default on photos at 0.9x
    the CPU."""
    dataplane = options.dataplane
    callers = options.process.workers * (dataplane.batching.num_batch_threads if dataplane.enable_batching else 1)
    return dataplane.tensorflow_intra_op_parallelism or max(1, cores // callers)


def session_config(dataplane: DataPlaneOptions) -> config_pb2.ConfigProto:
    """What TensorFlow reads only from the ConfigProto its runtime starts with, as tensorflow_model_server puts it
    in its session config: whether idle pool threads spin-wait (--tensorflow_thread_spinning) and the share of each
    GPU's memory the process takes (--per_process_gpu_memory_fraction; 0: TensorFlow's choice)."""
    config = config_pb2.ConfigProto()
    config.experimental.disable_thread_spinning = not dataplane.tensorflow_thread_spinning
    if dataplane.per_process_gpu_memory_fraction > 0:
        config.gpu_options.per_process_gpu_memory_fraction = dataplane.per_process_gpu_memory_fraction
    return config


def start_eager_context_with(config: config_pb2.ConfigProto, eager: context.Context) -> None:
    """Make `config` part of what `eager` (TensorFlow's eager context, not yet initialised) starts its runtime with.

    TF2 has no public setter for these fields: `tf.config` covers threads and devices, and `enable_eager_execution`
    takes a config only where eager execution is off. The context keeps the ConfigProto it was created with and
    applies `tf.config`'s settings over it when it starts; the CPU device's intra-op pool, the inter-op pool and
    the GPU allocator are created then, from that merged config. Every TF1 Session created without a config of its
    own (serving/core/loaders.py) takes the context's, so TF1 models get the same settings."""
    if eager._initialized:  # the context's own attributes: see above, there is no public way in
        raise RuntimeError("TensorFlow's runtime has already started")
    merged = config_pb2.ConfigProto()
    if eager._config is not None:
        merged.CopyFrom(eager._config)
    merged.MergeFrom(config)
    eager._config = merged


def _configure_tensorflow(options: ServerOptions) -> None:
    try:
        configure_runtime(options, context.context())
    except RuntimeError:
        logger.warning("TensorFlow was already initialised; thread and GPU settings unchanged")
        return
    _start_tensorflow_niced(options.dataplane.tensorflow_thread_nice)


def configure_runtime(options: ServerOptions, eager: context.Context) -> None:
    """Everything TensorFlow takes only before its runtime starts, given to `eager` (the process's eager
    context): the session config, GPU memory growth, the thread counts. RuntimeError once it has started."""
    cores = available_cores()
    dataplane = options.dataplane
    start_eager_context_with(session_config(dataplane), eager)
    share_gpus(tf.config.list_physical_devices("GPU"), options.process.workers)
    eager.intra_op_parallelism_threads = intra_op_threads(options, cores)
    eager.inter_op_parallelism_threads = dataplane.tensorflow_inter_op_parallelism or cores


def share_gpus(gpus: list, workers: int) -> None:
    """With several workers on one machine, each takes GPU memory as it needs it (memory growth) rather than
    nearly all of it at start, which would leave the second worker failing to allocate. One worker keeps
    TensorFlow's default, which allocates up front and fragments less."""
    if workers > 1:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)


def _start_tensorflow_niced(nice: int) -> None:
    """Start TensorFlow's runtime, and with it its thread pools, from a thread running `nice` steps lower than
    the rest of the worker. Linux gives each thread its own nice value and a new thread its creator's, so the pools
    that run the model inherit it, while the event loop, the batch threads and gRPC keep the normal priority.

    Why: on a busy worker the model's threads and the thread that reads requests compete for the same cores. When
    the reader waits for a core, fewer requests reach the batcher, batches stay small and each image costs the
    model more, and every response waits longer to be written. Lowered, the model gets every cycle the reader does
    not need. None of the lowered threads takes the GIL, so none can hold it while preempted."""
    def start() -> None:
        if nice and sys.platform == "linux":
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError as error:  # a sandbox that forbids it: the model runs at the normal priority
                logger.warning("could not lower TensorFlow's thread priority", extra={"fields": {"error": str(error)}})
        tf.config.list_logical_devices()  # initialises the runtime, which creates its thread pools
        tf.compat.v1.Session(graph=tf.Graph()).close()  # and the inter-op pool every TF1 model's Session shares

    thread = threading.Thread(target=start, name="petal-tf-start")
    thread.start()
    thread.join()


def create_core(options: ServerOptions, ports_to_open: int = 0) -> DataPlane:
    """Build this process's core and start loading its models in the background (readiness reports progress);
    it has started once they have loaded and `core.startup` has heard of each port opened.

    With several workers, a reload RPC reaches one of them; that worker applies it and publishes the config in
    --workers' shared directory, which every worker watches the way it watches --model_config_file.

    A derived memory budget is, in a cgroup, measured once the initial load and warmup are over (what the server
    then holds, page cache included, is known only then) and before the worker admits a request; until then the
    budget refuses bodies. Without a cgroup it is the estimate's, known at once (serving/server.py logs it).
    """
    global _current
    _configure_tensorflow(options)
    budget, pixels = resolve_memory_budget(options)
    dataplane = dataclasses.replace(options.dataplane, memory_budget_bytes=budget, max_inflight_pixels=pixels)
    measured = functools.partial(budget_after_load, options) if measures_memory_budget(options) else None
    core = DataPlane.create(dataplane, ports_to_open, drain_seconds=options.process.graceful_timeout,
                            budget_after_load=measured)
    watched: list[tuple[str, float, bytes]] = []
    if dataplane.model_config_file and dataplane.model_config_file_poll_wait_seconds > 0:
        watched.append((dataplane.model_config_file, dataplane.model_config_file_poll_wait_seconds,
                        dataplane.model_server_config().SerializeToString(deterministic=True)))
    if options.process.reload_dir:
        published = os.path.join(options.process.reload_dir, RELOAD_FILE)
        core.publish_config = functools.partial(_publish, published)
        watched.append((published, RELOAD_POLL_S, b""))
    for path, seconds, last in watched:
        threading.Thread(target=_watch_config, args=(core, path, seconds, last), name="petal-config",
                         daemon=True).start()
    _current = core
    return core


def _publish(path: str, config: model_server_config_pb2.ModelServerConfig) -> None:
    """Write the config where every worker looks, in one rename, so no worker reads half a file."""
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        f.write(text_format.MessageToString(config))
    os.replace(staging, path)


def _watch_config(core: DataPlane, path: str, seconds: float, last: bytes) -> None:
    """Re-read a config file; a broken one is logged and the running config kept, and so is a refused one (once)."""
    stop = threading.Event()  # a native wait: this thread must not start an event loop of its own under gevent
    while not core.draining() and not stop.wait(seconds):
        if not os.path.exists(path) and not last:
            continue
        try:
            config = read_model_config(path)
        except Exception as error:
            logger.warning("model config file unreadable; keeping the current one",
                           extra={"fields": {"path": path, "error": str(error)}})
            continue
        text = config.SerializeToString(deterministic=True)
        if text != last:
            try:
                core.reload_config(config, publish=False)
            except ServingError as error:  # check_model_config's rules, e.g. a base path outside --model_root
                logger.warning("model config refused; keeping the current one",
                               extra={"fields": {"path": path, "error": error.message}})
            else:
                logger.info("model config reloaded", extra={"fields": {"path": path, "models": core.model_names()}})
        last = text
