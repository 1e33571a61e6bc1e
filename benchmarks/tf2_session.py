"""The per-call cost of a TF2 SavedModel's signature run in a Session (serving/core/runtimes.py's
`SessionModel.of_tf2`, as TF Serving runs it) against its concrete function called flat (`FunctionModel`, the path
for TF2 models whose graph cannot stand alone), side by side in one process, interleaved in rounds.

    .venv/bin/python benchmarks/tf2_session.py [--model_base_path exported_models/flowers] [--rounds 8]

Both load the same version folder; their answers are checked equal first. Each call is timed in wall time, in the
process's CPU time (TensorFlow's pool threads included) and in the calling thread's CPU time (the Python and the
dispatch that hold the thread), under Petal's thread settings: one intra-op thread per caller.
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def per_call_ms(run, calls: int) -> tuple[float, float, float]:
    """(wall, process CPU, calling thread CPU) milliseconds per call."""
    wall, cpu, thread = time.perf_counter(), cpu_s(), time.thread_time()
    for _ in range(calls):
        run()
    return tuple(1000 * (after - before) / calls for after, before in  # type: ignore[return-value]
                 ((time.perf_counter(), wall), (cpu_s(), cpu), (time.thread_time(), thread)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_base_path", default=None, help="default: exported_models/flowers")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--images", type=int, default=200, help="images per round and path, at each batch size")
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
    import tensorflow as tf

    from exported_models.model_format import DEFAULT_MODEL_BASE_PATH, latest_version, meta_graph, read_saved_model
    from serving.core import runtimes
    from training.synth import CLASSES, render

    tf.config.threading.set_intra_op_parallelism_threads(1)
    path = latest_version(args.model_base_path or DEFAULT_MODEL_BASE_PATH)
    tags = runtimes.DEFAULT_TAGS
    graph = meta_graph(read_saved_model(path), set(tags))
    session = runtimes.SessionModel.of_tf2(path, graph, tags)
    if session is None:
        print(f"{path}: its graph does not stand alone, so Petal runs it as functions; nothing to compare")
        return 1
    models = {"function (flat call)": runtimes.FunctionModel(path, graph, tags), "Session (callable)": session}
    key = "serving_default"
    (name,) = graph.signature_def[key].inputs
    outputs = sorted(graph.signature_def[key].outputs)
    photos = [render(CLASSES[i % len(CLASSES)], seed=i, size=(480, 360)) for i in range(16)]
    print(f"{path}, {key}: ms per call, median of {args.rounds} rounds, the two paths in turn; 480x360 JPEGs")
    for batch in map(int, args.batches.split(",")):
        inputs = {name: np.array((photos * batch)[:batch], dtype=object)}
        answers = [model.run(key, inputs, outputs) for model in models.values()]
        for output in outputs:
            np.testing.assert_array_equal(answers[0][output], answers[1][output], err_msg=output)
        calls = max(1, args.images // batch)
        times: dict[str, list[tuple[float, float, float]]] = {title: [] for title in models}
        for _ in range(args.rounds):
            for title, model in models.items():
                times[title].append(per_call_ms(functools.partial(model.run, key, inputs, outputs), calls))
        for title, each in times.items():
            wall, cpu, thread = (statistics.median(t[i] for t in each) for i in range(3))
            print(f"batch {batch:>2}  {title:22s} wall {wall:7.3f}  process CPU {cpu:7.3f}  calling thread CPU "
                  f"{thread:6.3f}")
        ratios = [[f[i] / s[i] for f, s in zip(*times.values(), strict=True)] for i in range(3)]
        print(f"batch {batch:>2}  function / Session, median of the rounds' ratios: wall "
              f"{statistics.median(ratios[0]):.2f}, process CPU {statistics.median(ratios[1]):.2f}, calling thread "
              f"CPU {statistics.median(ratios[2]):.2f} (wall ratios {min(ratios[0]):.2f}-{max(ratios[0]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
