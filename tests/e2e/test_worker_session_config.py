"""The session config a worker starts TensorFlow with (serving/process/tensorflow_runtime.py) reaches TF2 and TF1 models
alike: a process configured as `petal serve` configures its workers, then a TF1 Session of a real foreign model and
the eager context are asked what they run with. A subprocess, since TensorFlow takes this config once per process."""
import json
import os
import subprocess
import sys

from server_harness import ROOT

PROBE = """
import gc, json, sys
from serving.process import tensorflow_runtime
from serving.process.flags import parse_args
from serving.core.runtimes import LoadOptions
from serving.core.servable import Servable
import numpy as np
from exported_models import tf_serving_models
from tensorflow.python.eager import context

tensorflow_runtime.configure_tensorflow(parse_args(sys.argv[1:]))
version = tf_serving_models.half_plus_two(sys.argv[-1].split("=", 1)[1] + "_tf1/1")  # TF Serving's TF1 test model
servable = Servable("m", 1, version, LoadOptions())
y = servable.run("serving_default", {"x": np.array([2.0], np.float32)})["y"]
assert y.tolist() == [3.0]  # y = x / 2 + 2
import tensorflow as tf
[session] = [o for o in gc.get_objects() if isinstance(o, tf.compat.v1.Session)]  # the one the model runs in
eager = context.context().config
print(json.dumps({
    "session_spinning_off": session._config.experimental.disable_thread_spinning,
    "session_gpu_fraction": session._config.gpu_options.per_process_gpu_memory_fraction,
    "eager_spinning_off": eager.experimental.disable_thread_spinning,
    "eager_gpu_fraction": eager.gpu_options.per_process_gpu_memory_fraction}))
"""


def probe(tmp_path, *flags: str) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", PROBE, *flags, "--tensorflow_thread_nice=0",
                          "--model_name=flowers", f"--model_base_path={tmp_path}/m"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_spinning_and_the_gpu_fraction_reach_the_eager_context_and_a_tf1_session(tmp_path):
    got = probe(tmp_path, "--tensorflow_thread_spinning=false", "--per_process_gpu_memory_fraction=0.25")
    assert got == {"session_spinning_off": True, "session_gpu_fraction": 0.25, "eager_spinning_off": True,
                   "eager_gpu_fraction": 0.25}
