"""The per-call cost of running a TF1 signature by tensor name: `Session.make_callable` with a feed list (which
goes through `Session.run` and its Python feed checks) against a callable built from CallableOptions (the C++
`Session::MakeCallable`, what serving/core/runtimes.py's SessionModel uses). Both run on one Session, interleaved in
rounds, so the ratio is measured side by side.

    .venv/bin/python benchmarks/session_callable.py [--rounds 30] [--calls 300]

The model is TF Serving's half_plus_two (exported_models/tf_serving_models.py), fed x of shape [batch, 1].
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_call_us(run, feed: np.ndarray, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run(feed)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.util import deprecation

    from exported_models.tf_serving_models import half_plus_two

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300, help="calls per round and path")
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = half_plus_two(os.path.join(folder, "1"))
        session = tf.compat.v1.Session(graph=tf.Graph())
        with deprecation.silence():  # the TF1 loader's notice, as serving/core/runtimes.py silences it
            tf.compat.v1.saved_model.load(session, ["serve"], path)
    paths = {"make_callable (Session.run)": session.make_callable(["y:0"], feed_list=["x:0"]),
             "CallableOptions (C++)": session._make_callable_from_options(
                 config_pb2.CallableOptions(feed=["x:0"], fetch=["y:0"]))}
    print(f"per call, microseconds: median of {args.rounds} rounds of {args.calls} calls, the two paths in turn")
    for batch in map(int, args.batches.split(",")):
        feed = np.arange(batch, dtype=np.float32).reshape(batch, 1)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for run in paths.values():  # warm both
            per_call_us(run, feed, args.calls)
        for _ in range(args.rounds):
            for name, run in paths.items():
                times[name].append(per_call_us(run, feed, args.calls))
        old, new = (statistics.median(t) for t in times.values())
        ratios = [a / b for a, b in zip(*times.values(), strict=True)]
        print(f"batch {batch:>3}: make_callable {old:7.1f}  CallableOptions {new:7.1f}  "
              f"old/new {statistics.median(ratios):.2f} (rounds' ratios {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
