"""How TensorFlow runs in a serving worker: its thread pools (sized to the cores, started below the worker's
priority), whether idle threads spin-wait, and each GPU's memory. All of it must be set before TensorFlow's runtime
starts, which `configure_tensorflow` does once per worker (serving/process/worker.py).
"""
from __future__ import annotations

import logging
import os
import sys
import threading

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from serving.host.cpus import available_cores
from serving.options.config import DataPlaneOptions, ServerOptions

logger = logging.getLogger(__name__)


def intra_op_threads(options: ServerOptions, cores: int) -> int:
    """Split the cores between everything that runs the model at once: each worker's batch threads (or, without
    batching, the worker itself). A pool per caller as large as the machine only spins: for the default model,
    one intra-op thread per batch thread gives 1.2-1.3x the images/s of TensorFlow's default on photos at 0.9x
    the CPU."""
    dataplane_options = options.dataplane
    per_worker = dataplane_options.batching.num_batch_threads if dataplane_options.enable_batching else 1
    callers = options.process.workers * per_worker
    return dataplane_options.tensorflow_intra_op_parallelism or max(1, cores // callers)


def session_config(dataplane_options: DataPlaneOptions) -> config_pb2.ConfigProto:
    """What TensorFlow reads only from the ConfigProto its runtime starts with, as tensorflow_model_server puts it
    in its session config: whether idle pool threads spin-wait (--tensorflow_thread_spinning) and the share of each
    GPU's memory the process takes (--per_process_gpu_memory_fraction; 0: TensorFlow's choice)."""
    config = config_pb2.ConfigProto()
    config.experimental.disable_thread_spinning = not dataplane_options.tensorflow_thread_spinning
    if dataplane_options.per_process_gpu_memory_fraction > 0:
        config.gpu_options.per_process_gpu_memory_fraction = dataplane_options.per_process_gpu_memory_fraction
    return config


def start_eager_context_with(config: config_pb2.ConfigProto, eager: context.Context) -> None:
    """Make `config` part of what `eager` (TensorFlow's eager context, not yet initialised) starts its runtime with.

    TF2 has no public setter for these fields: `tf.config` covers threads and devices, and `enable_eager_execution`
    takes a config only where eager execution is off. The context keeps the ConfigProto it was created with and
    applies `tf.config`'s settings over it when it starts; the CPU device's intra-op pool, the inter-op pool and
    the GPU allocator are created then, from that merged config. Every TF1 Session created without a config of its
    own (serving/core/runtimes.py) takes the context's, so TF1 models get the same settings."""
    if eager._initialized:  # the context's own attributes: see above, there is no public way in
        raise RuntimeError("TensorFlow's runtime has already started")
    merged = config_pb2.ConfigProto()
    if eager._config is not None:
        merged.CopyFrom(eager._config)
    merged.MergeFrom(config)
    eager._config = merged


def configure_tensorflow(options: ServerOptions) -> None:
    """Set up TensorFlow's runtime for this worker and start it, its compute threads niced
    (--tensorflow_thread_nice)."""
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
    dataplane_options = options.dataplane
    start_eager_context_with(session_config(dataplane_options), eager)
    share_gpus(tf.config.list_physical_devices("GPU"), options.process.workers)
    eager.intra_op_parallelism_threads = intra_op_threads(options, cores)
    eager.inter_op_parallelism_threads = dataplane_options.tensorflow_inter_op_parallelism or cores


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
