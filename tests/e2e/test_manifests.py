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
from serving.memory import ESTIMATE_SLACK, HEADROOM

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
    assert peaks.working_set - idle.working_set > budget / 4, f"the flood did not reach the budget ({summary})"
    assert peaks.working_set <= (1 - HEADROOM) * limit, summary
    assert peaks.last is not None and peaks.last.failed_charges == 0, summary
    assert peaks.last.oom_kills == 0 and alive, summary
