"""Run TF Serving's own integration suite, tensorflow_model_server_test.py, against `petal serve`.

    .venv/bin/pip install portpicker six tf-keras==<TensorFlow's version>
    .venv/bin/python tests/tf_serving_suite.py --serving /path/to/tensorflow/serving [--petal DIR] [test names...]

`--serving` is a checkout of github.com/tensorflow/serving. The suite starts `tensorflow_model_server` from its
Bazel runfiles (`$TEST_SRCDIR/tf_serving/tensorflow_serving/model_servers/`) with TF Serving's flags and reads its
models from `servables/tensorflow/testdata` there: this script lays out such a folder in a temporary directory,
the checkout's `tensorflow_serving` linked in, and in it a `tensorflow_model_server` that runs `petal serve` with
the flags it is given (the Petal of `--petal`, a checkout, by default this one, on this interpreter). The suite's
Keras tests save tf.keras 2 models, so it runs with TF_USE_LEGACY_KERAS=1 (tf-keras installed), as TF Serving's
CI does. Test names (`TensorflowModelServerTest.testPredictOnTfLite`) run those alone. docs/development.md says
which tests need what.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SUITE = """import os, runpy, sys
import tensorflow_serving
src = os.path.join(os.environ["TEST_SRCDIR"], "tf_serving", "tensorflow_serving")
tensorflow_serving.__path__.append(src)  # the wheel ships apis/ and config/; the suite's modules come from src
test = os.path.join(src, "model_servers", "tensorflow_model_server_test.py")
sys.argv = [test] + sys.argv[1:]
runpy.run_path(test, run_name="__main__")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serving", required=True, help="a checkout of tensorflow/serving")
    parser.add_argument("--petal", default=ROOT, help="the Petal checkout to serve with (default: this one)")
    parser.add_argument("tests", nargs="*", help="test names, as absltest takes them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tf-serving-suite-") as runfiles:
        source = os.path.join(runfiles, "tf_serving", "tensorflow_serving")
        servers = os.path.join(source, "model_servers")
        os.makedirs(servers)
        upstream = os.path.join(os.path.abspath(args.serving), "tensorflow_serving")
        for entry in os.listdir(upstream):  # all linked in but model_servers, which gets the binary besides
            if entry != "model_servers":
                os.symlink(os.path.join(upstream, entry), os.path.join(source, entry))
        for entry in os.listdir(os.path.join(upstream, "model_servers")):
            if entry != "tensorflow_model_server":
                os.symlink(os.path.join(upstream, "model_servers", entry), os.path.join(servers, entry))
        binary = os.path.join(servers, "tensorflow_model_server")
        with open(binary, "w") as f:
            f.write(f'#!/bin/sh\ncd "{os.path.abspath(args.petal)}" && exec "{sys.executable}" petal.py serve "$@"\n')
        os.chmod(binary, 0o755)
        env = dict(os.environ, TEST_SRCDIR=runfiles, TF_USE_LEGACY_KERAS="1")
        return subprocess.call([sys.executable, "-c", RUN_SUITE, *args.tests], env=env)


if __name__ == "__main__":
    sys.exit(main())
