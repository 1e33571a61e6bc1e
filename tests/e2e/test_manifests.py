"""The probe paths the deployment files name answer on a real `petal serve` started with the Deployment's args
(the files' own checks, which need no server, are tests/unit/test_manifest_files.py).
"""
from __future__ import annotations

import re
import urllib.request

from deploy_files import kubernetes_objects, pod_container, read_dockerfile

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
