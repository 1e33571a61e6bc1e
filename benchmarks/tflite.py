"""--prefer_tflite_model against the SavedModel, on the shipped flowers model, side by side in one run: is TensorFlow's
TFLite interpreter a faster runtime for a small model on CPU?

    .venv/bin/python benchmarks/tflite.py [--rounds 5] [--seconds 2] [--batches 1,8] [--concurrency 1,8]

The shipped model's `serving_default` decodes JPEGs (DecodeImage), which TFLite runs only through its Flex
delegate, and the interpreter of TensorFlow's pip wheel has none ("Select TensorFlow op(s) ... not supported by
this interpreter"). So what is compared is the model proper: its `predict_images` signature (float pixels
[N, 64, 64, 3]) to its probabilities (its class names come from a table TFLite's builtin ops cannot fill), saved as
a SavedModel and converted with TFLite's builtin ops into `model.tflite` beside it (TF Serving's layout, where
--prefer_tflite_model finds it; `petal export` writes none): one graph, two runtimes.

Two measures, each interleaved round by round (this machine drifts by 20% and more: only a ratio taken within a
round means anything; the median over rounds is printed):
- in-process: Petal's own `Servable` of each format (serving/core), one call after another on one thread, for each
  batch size: images/s and CPU per image (the process's CPU time over the images);
- served: two `petal serve`, the same version folder, one with --prefer_tflite_model, gRPC Predict of one image per
  call from `concurrency` client threads: images/s and the server's CPU per image (its processes' CPU time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from serving.tensorflow_logs import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
import tensorflow as tf  # noqa: E402
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402

from load_tests.launcher import running  # noqa: E402
from serving.core import Servable  # noqa: E402
from serving.core.runtimes import LoadOptions  # noqa: E402

SIGNATURE = "predict_images"
SHIPPED = os.path.join(ROOT, "exported_models", "flowers", "1")


class _Pixels(tf.Module):
    """The shipped model's `predict_images` to its probabilities alone: its class names come from a table filled
    from labels.txt, which TFLite's builtin ops cannot fill ("hashtable need to be initialized")."""

    def __init__(self, shipped) -> None:
        super().__init__()
        self.shipped = shipped
        self.predict_images = tf.function(
            lambda images: {"probabilities": shipped.predict_images(images)["probabilities"]},
            input_signature=[tf.TensorSpec([None, 64, 64, 3], tf.float32, name="images")])


def prepare(folder: str) -> str:
    """A version folder holding the shipped model's pixels-to-probabilities as a SavedModel and, converted with
    TFLite's builtin ops, as `model.tflite` beside it (TF Serving's layout); its base path."""
    version = os.path.join(folder, "flowers", "1")
    module = _Pixels(tf.saved_model.load(SHIPPED))
    tf.saved_model.save(module, version, signatures={SIGNATURE: module.predict_images})
    converter = tf.lite.TFLiteConverter.from_saved_model(version, signature_keys=[SIGNATURE])
    with open(os.path.join(version, "model.tflite"), "wb") as f:
        f.write(converter.convert())
    return os.path.dirname(version)


def images(batch: int) -> np.ndarray:
    return np.random.default_rng(0).random((batch, 64, 64, 3), dtype=np.float32)


def in_process(servable: Servable, batch: int, seconds: float) -> tuple[float, float]:
    """Images/s and CPU ms per image of calls one after another for `seconds`."""
    inputs = {"images": images(batch)}
    servable.run(SIGNATURE, inputs)
    n, wall, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        servable.run(SIGNATURE, inputs)
        n += batch
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return n / wall, 1000 * cpu / n


def server_cpu(pid: int) -> float:
    """A served Petal's CPU seconds: its master and workers."""
    process = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def served(target: str, pid: int, concurrency: int, seconds: float) -> tuple[float, float]:
    """Images/s and the server's CPU ms per image of one-image Predicts from `concurrency` threads."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "flowers", SIGNATURE
    request.inputs["images"].CopyFrom(tf.make_tensor_proto(images(1)))
    channel = grpc.insecure_channel(target)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    stub.Predict(request, timeout=30)
    counts, end = [0] * concurrency, time.perf_counter() + seconds

    def send(i: int) -> None:
        while time.perf_counter() < end:
            stub.Predict(request, timeout=30)
            counts[i] += 1
    threads = [threading.Thread(target=send, args=(i,)) for i in range(concurrency)]
    cpu, wall = server_cpu(pid), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - wall, server_cpu(pid) - cpu
    channel.close()
    return sum(counts) / wall, 1000 * cpu / sum(counts)


def median_table(title: str, rows: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]]) -> None:
    print(f"\n{title}: median over rounds (TFLite ÷ SavedModel ratios taken within each round)")
    print(f"{'cell':<16}{'SavedModel img/s':>18}{'TFLite img/s':>14}{'ratio':>8}"
          f"{'SavedModel CPU ms/img':>23}{'TFLite CPU ms/img':>19}{'ratio':>8}")
    for cell, results in rows.items():
        med = statistics.median
        speed = [lite[0] / saved[0] for saved, lite in results]
        cpu = [lite[1] / saved[1] for saved, lite in results]
        print(f"{cell:<16}{med(s[0] for s, _ in results):>18.1f}{med(t[0] for _, t in results):>14.1f}"
              f"{med(speed):>8.2f}{med(s[1] for s, _ in results):>23.3f}{med(t[1] for _, t in results):>19.3f}"
              f"{med(cpu):>8.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per cell and format, each round")
    parser.add_argument("--batches", default="1,8", help="in-process batch sizes")
    parser.add_argument("--concurrency", default="1,8", help="served: client threads")
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="petal-tflite-bench-") as folder:
        base = prepare(folder)
        version = os.path.join(base, "1")
        servables = {"saved": Servable("flowers", 1, version),
                     "tflite": Servable("flowers", 1, version, LoadOptions(prefer_tflite=True))}
        assert servables["tflite"].format == "tflite" and servables["saved"].format != "tflite"
        check = {name: s.run(SIGNATURE, {"images": images(4)}) for name, s in servables.items()}
        outputs = list(check["saved"])
        print("outputs agree (max |difference|): " + ", ".join(
            f"{k} {np.max(np.abs(check['saved'][k] - check['tflite'][k])):.2g}" for k in outputs
            if check["saved"][k].dtype.kind == "f"))
        rows: dict[str, list] = {}
        for round_ in range(args.rounds):
            for batch in map(int, args.batches.split(",")):
                pair = [in_process(servables[name], batch, args.seconds)
                        for name in (("saved", "tflite") if round_ % 2 == 0 else ("tflite", "saved"))]
                rows.setdefault(f"batch {batch}", []).append(pair if round_ % 2 == 0 else pair[::-1])
        median_table("in-process, Petal's Servable, one thread", rows)
        flags = [f"--model_base_path={base}", "--model_name=flowers", "--workers=1"]
        with running(flags) as saved_server, running([*flags, "--prefer_tflite_model"]) as lite_server:
            servers = {"saved": saved_server, "tflite": lite_server}
            rows = {}
            for round_ in range(args.rounds):
                for concurrency in map(int, args.concurrency.split(",")):
                    order = ("saved", "tflite") if round_ % 2 == 0 else ("tflite", "saved")
                    pair = [served(servers[n].grpc_target, servers[n].proc.pid, concurrency, args.seconds)
                            for n in order]
                    rows.setdefault(f"c={concurrency}", []).append(pair if round_ % 2 == 0 else pair[::-1])
        median_table("served, gRPC Predict of one image, default flags + --workers=1", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
