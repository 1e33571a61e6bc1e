"""What TensorFlow is told before its runtime starts in a worker (serving/process/worker.py): the session config
(spin-waits, GPU memory fraction), memory growth when workers share a GPU, the thread counts. Each test hands the
configuration to a fresh eager context, as the worker hands it to the process's; only a GPU's existence is mocked, since
none can exist here."""
from __future__ import annotations

from unittest import mock

import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from serving.process import tensorflow_runtime
from serving.process.flags import parse_args

FAKE_GPU = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")


def configured(argv: list[str], gpus: list) -> tuple[tf.compat.v1.ConfigProto, list]:
    """The ConfigProto a fresh eager context would start its runtime with under these flags, and the memory growth
    calls made, on a machine with `gpus`."""
    eager = context.Context()
    growth = []
    with mock.patch.object(tf.config, "list_physical_devices", lambda kind=None: gpus if kind == "GPU" else []), \
            mock.patch.object(tf.config.experimental, "set_memory_growth",
                              lambda device, enable: growth.append((device.name, enable))):
        tensorflow_runtime.configure_runtime(parse_args(argv), eager)
    return eager.config, growth


def test_thread_spinning_is_the_runtimes_disable_thread_spinning_and_threads_stay_as_set():
    config, _ = configured(["--tensorflow_thread_spinning=false", "--tensorflow_intra_op_parallelism=3",
                            "--tensorflow_inter_op_parallelism=5"], [])
    assert config.experimental.disable_thread_spinning
    assert (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) == (3, 5)
    config, _ = configured(["--tensorflow_thread_spinning=true"], [])
    assert not config.experimental.disable_thread_spinning


def test_the_default_spinning_is_the_flags_default():
    config, _ = configured([], [])
    assert config.experimental.disable_thread_spinning == (not parse_args([]).dataplane.tensorflow_thread_spinning)


def test_per_process_gpu_memory_fraction_reaches_the_gpu_options_as_in_tf_serving():
    config, growth = configured(["--per_process_gpu_memory_fraction=0.4"], [FAKE_GPU])
    assert config.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.4)
    assert growth == [], "one worker keeps TensorFlow's allocation up front"
    config, _ = configured([], [FAKE_GPU])
    assert config.gpu_options.per_process_gpu_memory_fraction == 0, "0: TensorFlow's choice"


def test_workers_sharing_a_gpu_grow_their_memory_instead_of_taking_it_all_at_start():
    _, growth = configured(["--workers=2"], [FAKE_GPU])
    assert growth == [(FAKE_GPU.name, True)]
    config, growth = configured(["--workers=3", "--per_process_gpu_memory_fraction=0.3"], [FAKE_GPU])
    assert growth == [(FAKE_GPU.name, True)]
    assert config.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.3)
    _, growth = configured(["--workers=2"], [])
    assert growth == [], "no GPU, nothing to share"


def test_a_negative_fraction_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--per_process_gpu_memory_fraction=-0.5"])
    assert "--per_process_gpu_memory_fraction" in capsys.readouterr().err


def test_a_started_runtime_is_not_reconfigured():
    eager = context.Context()
    eager.ensure_initialized()  # as its first op does
    with pytest.raises(RuntimeError):
        tensorflow_runtime.start_eager_context_with(tensorflow_runtime.session_config(parse_args([]).dataplane), eager)
