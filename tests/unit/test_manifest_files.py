"""The deployment files agree with the server they deploy: every YAML under deploy/ parses, and the ports, probe
paths, drain timeouts, user and selectors in the Dockerfile, Compose file and Kubernetes manifests match what
`petal serve` actually listens on and how long it takes to drain.

Server facts come from the server itself: flags are parsed with `petal serve`'s own parser (the image's ENTRYPOINT
flags plus each manifest's args, as the container would receive them). That a real `petal serve` answers on the
probe paths is tests/e2e/test_manifests.py's test.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from deploy_files import (
    API_VERSIONS,
    COMPOSE,
    DEPLOY,
    KUBERNETES,
    ROOT,
    container_env,
    cpu_cores,
    dockerignore_excludes,
    kubernetes_objects,
    memory_bytes,
    pod_container,
    read_dockerfile,
    server_options,
    yaml_files,
)
from serving.host.cpus import available_cores
from serving.host.memory import ESTIMATE_SLACK, HEADROOM, CgroupMemory, MiB, measured_footprint
from serving.memory_costs import BODY_BYTES_FACTOR, BYTES_PER_PIXEL
from serving.options.config import ServerOptions
from serving.process.memory_budget import resolve_memory_budget
from serving.process.tensorflow_runtime import intra_op_threads

# What a fresh pod of the image holds once loaded, page cache included, with a cold cache: 949-1073 MiB over 16
# starts (benchmarks/memory.py --pod_limit, tests/e2e/test_manifests.py), rounded up from the most.
POD_FOOTPRINT = 1080 * MiB

# --- every file ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses_into_mappings(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs and all(isinstance(doc, dict) and doc for doc in docs), f"{path}: empty or not a mapping"


def test_kubernetes_objects_have_known_kinds_and_names():
    paths = sorted(KUBERNETES.glob("*"))
    assert paths, f"no Kubernetes files in {KUBERNETES}"
    for path in paths:
        assert path.suffix == ".yaml", f"{path}: Kubernetes files end in .yaml"
        for doc in yaml.safe_load_all(path.read_text()):
            assert API_VERSIONS.get(doc["kind"]) == doc["apiVersion"], f"{path}: {doc['kind']} {doc['apiVersion']}"
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"] == "petal"


def test_kustomization_lists_every_manifest():
    kustomization = kubernetes_objects()["Kustomization"]
    manifests = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)


def served_models(options: ServerOptions) -> list[tuple[str, str]]:
    return [(m.name, m.base_path) for m in options.dataplane.model_config.model_config_list.config]


# --- the image -------------------------------------------------------------------------------------------------

def test_image_ports_healthcheck_and_user_match_the_server():
    dockerfile = read_dockerfile()
    options = server_options(dockerfile, [])
    assert dockerfile.exposed == {options.protocols.port, options.protocols.rest_api_port}
    assert served_models(options) == [("flowers", "/models/flowers")]
    uid = dockerfile.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER, so runAsNonRoot can verify it"
    program = dockerfile.healthcheck[-1]
    assert f"127.0.0.1:{options.protocols.rest_api_port}/readyz" in program


def test_image_flags_pass_through_after_the_defaults():
    options = server_options(read_dockerfile(), ["--rest_api_port=9001", "--workers=3"], {"MODEL_NAME": "iris"})
    assert (options.protocols.rest_api_port, options.process.workers) == (9001, 3)
    assert served_models(options) == [("iris", "/models/iris")]


def test_dockerignore_keeps_what_the_image_copies_and_drops_the_rest():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copies = read_dockerfile().copies
    assert copies, "the Dockerfile's COPY lines were not found"
    for source in copies:
        assert not dockerignore_excludes(source, patterns), f"COPY {source} is excluded from the build context"
    for heavy in (".venv", "data", "runs", "tests", ".git", "exported_models/other_model", "serving/__pycache__"):
        assert dockerignore_excludes(heavy, patterns), f"{heavy} would be sent to the builder"


# --- Kubernetes ------------------------------------------------------------------------------------------------

def test_deployment_ports_and_probes_match_the_server():
    objects = kubernetes_objects()
    container = pod_container(objects)
    options = server_options(read_dockerfile(), container["args"], container_env(container))
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": options.protocols.port, "http": options.protocols.rest_api_port}
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/healthz"
    for probe in probes.values():
        assert ports.get(probe["port"], probe["port"]) == options.protocols.rest_api_port
    annotations = objects["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == options.protocols.rest_api_port
    assert annotations["prometheus.io/path"] == options.protocols.metrics_path


def test_grace_period_outlasts_prestop_and_drain():
    objects = kubernetes_objects()
    container = pod_container(objects)
    options = server_options(read_dockerfile(), container["args"], container_env(container))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = objects["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop[1]) + options.process.graceful_timeout


def test_resources_fit_the_server_threads_and_the_autoscaler(tmp_path):
    objects = kubernetes_objects()
    container = pod_container(objects)
    options = server_options(read_dockerfile(), container["args"], container_env(container))
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert cpu_cores(requests["cpu"]) <= cpu_cores(limits["cpu"])
    assert memory_bytes(requests["memory"]) <= memory_bytes(limits["memory"])
    (tmp_path / "cpu.max").write_text(f"{int(cpu_cores(limits['cpu']) * 100_000)} 100000\n")  # the pod's cgroup
    cores = available_cores(str(tmp_path))
    assert cores <= math.ceil(cpu_cores(limits["cpu"])), "thread pools must be sized by the CPU limit"
    assert 0 < intra_op_threads(options, cores) * options.process.workers <= cores, \
        "TensorFlow must not start more threads than the CPU limit allows"
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"], "utilisation needs the cpu request above"
    assert 2 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert objects["PodDisruptionBudget"]["spec"]["maxUnavailable"] < hpa["minReplicas"]
    assert "replicas" not in objects["Deployment"]["spec"], "the autoscaler owns the replica count"


def test_memory_limit_holds_the_loaded_server_the_default_budget_and_the_headroom():
    """The memory budget is derived from the pod's limit less what the pod holds once loaded, page cache included
    (POD_FOOTPRINT), so that no flood takes the pod past 85% of its limit or to it; the limit must leave room for
    more than one largest request (tests/e2e/test_manifests.py floods a real pod of this limit)."""
    container = pod_container(kubernetes_objects())
    limit = memory_bytes(container["resources"]["limits"]["memory"])
    options = server_options(read_dockerfile(), container["args"], container_env(container))
    for pinned in ("--memory_budget_bytes", "--max_inflight_pixels"):
        assert not any(arg.startswith(pinned) for arg in container["args"]), f"{pinned}: derived, not pinned"
    footprint = measured_footprint(CgroupMemory(1, limit, POD_FOOTPRINT, 0, 0, 0, 0))
    budget, _ = resolve_memory_budget(options, footprint)
    workers = options.process.workers
    one_request = (options.dataplane.max_image_pixels * BYTES_PER_PIXEL
                   + options.protocols.max_request_bytes * BODY_BYTES_FACTOR)
    assert budget >= 2 * one_request, "the pod should hold more than one largest request at a time"
    assert POD_FOOTPRINT + workers * budget * (1 + ESTIMATE_SLACK) <= (1 - HEADROOM) * limit


def test_selectors_targets_and_user_line_up():
    objects = kubernetes_objects()
    deployment = objects["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], objects["Service"]["spec"]["selector"],
                     objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    target = objects["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "petal")
    container = pod_container(objects)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert {p["targetPort"]: p["port"] for p in objects["Service"]["spec"]["ports"]} == ports
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and str(security["runAsUser"]) == read_dockerfile().user.split(":")[0]


# --- Compose ---------------------------------------------------------------------------------------------------

def compose_duration_s(text: str) -> float:
    seconds = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * seconds[unit] for n, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def test_compose_serves_the_image_and_points_locust_at_it():
    import load_tests
    from load_tests.runner import build_parser

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    dockerfile = read_dockerfile()
    petal = services["petal"]
    options = server_options(dockerfile, petal["command"], petal["environment"])
    published = {int(mapping.split(":")[1]) for mapping in petal["ports"]}
    assert published == {options.protocols.port, options.protocols.rest_api_port}
    assert compose_duration_s(petal["stop_grace_period"]) > options.process.graceful_timeout
    models = re.fullmatch(r"\$\{PETAL_MODELS:-(?P<default>[^}]+)\}:(?P<target>[^:]+):ro", petal["volumes"][0])
    assert models and models["target"] == dockerfile.env["MODEL_BASE_PATH"]
    assert (DEPLOY / models["default"]).resolve() == ROOT / "exported_models"

    locust = services["locust"]
    assert locust["depends_on"]["petal"]["condition"] == "service_healthy"
    assert locust["build"]["context"] == petal["build"]["context"] == ".."
    load = build_parser().parse_args(locust["command"])
    assert load.host == f"http://petal:{options.protocols.rest_api_port}"
    assert load.grpc_host == f"petal:{options.protocols.port}"
    assert "volumes" not in locust, "the image's installed locustfile and SLO file are used, not a checkout's"
    for used in (load.locustfile, load.slo):
        assert used.is_file() and used.parent == Path(load_tests.__file__).parent
