"""The Deployment on a real `petal serve`: the probe paths the deployment files name answer on a server started
with its args, and a fresh pod of its memory limit holds a pixel flood within the limit (the files' own checks,
which need no server, are tests/unit/test_manifest_files.py).
"""
from __future__ import annotations

import re
import urllib.request

import pytest
import requests

from deploy_files import kubernetes_objects, memory_bytes, pod_container, read_dockerfile
from load_tests import fresh_pod
from serving.host.memory import ESTIMATE_SLACK, HEADROOM

# --- the real server -------------------------------------------------------------------------------------------

def test_probe_paths_answer_on_a_server_started_with_the_deployment_args():
    from server_harness import run_server, tiny_model_base

    objects = kubernetes_objects()
    container = pod_container(objects)
    paths = {container[kind]["httpGet"]["path"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    paths.add(objects["Deployment"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])
    paths.add(re.search(r"https?://[^/]+(/[^'\"]*)", read_dockerfile().healthcheck[-1]).group(1))
    with run_server(*container["args"], f"--model_base_path={tiny_model_base()}", "--model_name=flowers") as server:
        for path in sorted(paths):
            with urllib.request.urlopen(server.rest_url + path, timeout=10) as response:
                assert response.status == 200, path


# --- a fresh pod under a pixel flood ---------------------------------------------------------------------------

MiB = 1 << 20
# 8 clients, each posting :predict with 32 flat 6000 x 6000 JPEGs (23 MB of JSON, 3.5 GB decoded): far more than
# a pod's budget holds. The budget admits a few at once and refuses the rest; the REST deadline, shortened from 30 s,
# ends the ones admitted sooner: it bounds the test's time, not what a request holds, which peaks within seconds.
CLIENTS, IMAGES, SIDE = 8, 32, 6000
DEADLINE_MS = 10_000


def budget_bytes(server) -> int:
    text = requests.get(server.rest_url + "/monitoring/prometheus/metrics", timeout=10).text
    return sum(int(float(v)) for v in re.findall(r":petal:serving:memory_budget_bytes\{kind=\"\w+\"\} (\S+)", text))


def test_a_fresh_pod_of_the_deployment_holds_a_pixel_flood_within_its_limit():
    """Started as a new pod is (its own memory cgroup of the Deployment's limit, a cold page cache, so that it is
    charged for TensorFlow's libraries and the model as it reads them), the server derives its budget from what
    the cgroup holds once it has loaded, and under the flood its working set stays within 85% of the limit, the
    cgroup never reaches the limit (no failed charge: the kernel never had to reclaim the pod's own pages) and
    nothing is OOM-killed; every request is answered 200, 503 or 504. Where a memory cgroup cannot be made (not
    root, no memory controller) it is skipped, saying why."""
    from load_tests.pixel_flood import flat_jpeg, flood, flood_requests
    from server_harness import run_server

    reason = fresh_pod.unavailable()
    if reason:
        pytest.skip(f"no fresh pod on this machine: {reason}")
    container = pod_container(kubernetes_objects())
    limit = memory_bytes(container["resources"]["limits"]["memory"])
    image = flat_jpeg(SIDE)
    with fresh_pod.fresh_pod(limit) as pod, \
            run_server(*container["args"], f"--rest_api_timeout_in_ms={DEADLINE_MS}", env=pod.env,
                       wrapper=pod.wrapper) as server:
        idle = pod.read()
        budget = budget_bytes(server)
        with pod.sampled() as peaks:
            statuses = flood(flood_requests("rest", server, image, IMAGES, CLIENTS, timeout_s=60))
        alive = server.proc.poll() is None
    summary = (f"limit {limit / MiB:.0f} MiB; idle usage {idle.usage / MiB:.0f}, working set "
               f"{idle.working_set / MiB:.0f}, file {idle.file / MiB:.0f}; budget {budget / MiB:.0f}; peak working "
               f"set {peaks.working_set / MiB:.0f}, usage {peaks.usage / MiB:.0f}; answers {statuses}")
    print(summary)  # where it ran and what it measured, for -rP
    assert idle.file > 256 * MiB, f"the pod was not charged for its libraries: not a cold start ({summary})"
    expected = (limit * (1 - HEADROOM) - idle.usage) / (1 + ESTIMATE_SLACK)
    assert abs(budget - expected) < 32 * MiB, f"the budget is not the one the idle cgroup gives ({summary})"
    assert sum(statuses.values()) == CLIENTS and set(statuses) <= {200, 503, 504}, summary
    # the flood reached the budget: it refused some (503), or what it admitted grew the working set (memory freed
    # goes back at once, so a sample can miss most of the peak: once 162 MB against a bound of 163)
    assert 503 in statuses or peaks.working_set - idle.working_set > budget / 4, \
        f"the flood did not reach the budget ({summary})"
    assert peaks.working_set <= (1 - HEADROOM) * limit, summary
    assert peaks.last is not None and peaks.last.failed_charges == 0, summary
    assert peaks.last.oom_kills == 0 and alive, summary


# --- a fresh pod serving a model whose batches' activations would pass its limit -------------------------------

ROW_FLOATS = 24 << 20  # float32s a row of the hungry model tiles its input to: 96 MiB, twice (the tile, the product)
HUNGRY_CLIENTS, HUNGRY_IMAGES = 8, 2  # 16 rows at once: 3 GiB of activations in one batch


def hungry_model(base) -> str:
    """A model of two tiny inputs' worth of pixels but 192 MiB of activations a row, exported with a warmup request
    as Petal's export writes one: batched as the default `max_batch_size` allows, its batches hold gigabytes."""
    import numpy as np
    import tensorflow as tf

    from exported_models import model_format
    from server_harness import jpeg

    class Hungry(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")])
        def serve(self, image_bytes):
            lengths = tf.cast(tf.strings.length(image_bytes), tf.float32)
            total = tf.reduce_sum(tf.tile(lengths[:, None], [1, ROW_FLOATS]) * 0.5, axis=1)
            return {"probabilities": tf.stack([tf.sigmoid(total), 1 - tf.sigmoid(total)], axis=1)}

    module = Hungry()
    version = str(base / "1")
    tf.saved_model.save(module, version, signatures={"serving_default": module.serve})
    model_format.write_warmup(version, "flowers", [model_format.WarmupRequest(
        "serving_default", {"image_bytes": np.array([jpeg()], dtype=object)})])
    return str(base)


def test_a_fresh_pod_budgets_the_activations_of_a_model_whose_batches_would_pass_its_limit(tmp_path):
    """The hungry model in a fresh pod of the Deployment's limit, 16 rows sent at once: its batches, as large as
    `max_batch_size` lets them (its CPU per image is the same at every size, so its measured cost caps nothing),
    would hold 3 GiB of activations. The load measures a row's (serving/core/cost.py) and the budget charges each
    batch for them, so every request is answered 200 and the working set stays within 85% of the limit, with no
    failed charge and nothing OOM-killed."""
    from load_tests.pixel_flood import flood, flood_requests
    from server_harness import jpeg, run_server

    reason = fresh_pod.unavailable()
    if reason:
        pytest.skip(f"no fresh pod on this machine: {reason}")
    container = pod_container(kubernetes_objects())
    limit = memory_bytes(container["resources"]["limits"]["memory"])
    assert HUNGRY_CLIENTS * HUNGRY_IMAGES * 2 * ROW_FLOATS * 4 > limit, "the batches would not pass the limit"
    base = hungry_model(tmp_path / "hungry")
    with fresh_pod.fresh_pod(limit) as pod, \
            run_server(*container["args"], "--model_name=flowers", f"--model_base_path={base}", env=pod.env,
                       wrapper=pod.wrapper) as server:
        idle = pod.read()
        budget = budget_bytes(server)
        with pod.sampled() as peaks:
            statuses = flood(flood_requests("rest", server, jpeg(), HUNGRY_IMAGES, HUNGRY_CLIENTS, timeout_s=120))
        alive = server.proc.poll() is None
    summary = (f"limit {limit / MiB:.0f} MiB; idle usage {idle.usage / MiB:.0f}, working set "
               f"{idle.working_set / MiB:.0f}; budget {budget / MiB:.0f}; peak working set "
               f"{peaks.working_set / MiB:.0f} ({peaks.working_set / limit:.0%}), usage {peaks.usage / MiB:.0f}; "
               f"answers {statuses}")
    print(summary)  # where it ran and what it measured, for -rP
    assert statuses == {200: HUNGRY_CLIENTS}, summary
    assert peaks.working_set <= (1 - HEADROOM) * limit, summary
    assert peaks.last is not None and peaks.last.failed_charges == 0, summary
    assert peaks.last.oom_kills == 0 and alive, summary
