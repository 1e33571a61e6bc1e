"""Reading the deployment files (the Dockerfile, the Compose file, the Kubernetes manifests) as Docker and Kubernetes
would apply them: tests/unit/test_manifest_files.py checks them against the server, tests/e2e/test_manifests.py
starts one with their args."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import string
from dataclasses import dataclass
from pathlib import Path

import yaml

from serving.options.config import ServerOptions
from serving.process.flags import parse_args

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "docker-compose.yml"
API_VERSIONS = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "PodDisruptionBudget": "policy/v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}


@dataclass(frozen=True)
class Dockerfile:
    """The runtime (last) stage's settings, as Docker would apply them."""

    env: dict[str, str]
    user: str
    exposed: set[int]
    healthcheck: list[str]
    entrypoint: list[str]
    copies: list[str]


def read_dockerfile(path: Path = ROOT / "Dockerfile") -> Dockerfile:
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = [line.strip().split(None, 1) for line in text.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, (op, _) in enumerate(instructions) if op.upper() == "FROM")
    env: dict[str, str] = {}
    user, exposed, healthcheck, entrypoint, copies = "", set(), [], [], []
    for op, rest in instructions:
        op = op.upper()
        if op == "COPY" and "--from=" not in rest:
            copies.extend(word for word in shlex.split(rest)[:-1] if not word.startswith("--"))
    for op, rest in instructions[last_from:]:
        op = op.upper()
        if op == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(rest))
        elif op == "USER":
            user = rest.strip()
        elif op == "EXPOSE":
            exposed |= {int(port.split("/")[0]) for port in rest.split()}
        elif op == "HEALTHCHECK":
            healthcheck = json.loads(rest[rest.index(" CMD ") + len(" CMD "):])
        elif op == "ENTRYPOINT":
            entrypoint = json.loads(rest)
    return Dockerfile(env, user, exposed, healthcheck, entrypoint, copies)


def server_argv(dockerfile: Dockerfile, args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The `petal serve` flags a container receives: the ENTRYPOINT's own, env-expanded, then the extra args."""
    shell, dash_c, script = dockerfile.entrypoint[:3]
    assert (shell, dash_c) == ("/bin/sh", "-c")
    words = shlex.split(script)
    assert words[:3] == ["exec", "petal", "serve"] and words[-1] == "$@", script
    variables = {**dockerfile.env, **(env or {})}
    return [string.Template(word).substitute(variables) for word in words[3:-1]] + list(args)


def server_options(dockerfile: Dockerfile, args: list[str], env: dict[str, str] | None = None) -> ServerOptions:
    return parse_args(server_argv(dockerfile, args, env))


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def kubernetes_objects() -> dict[str, dict]:
    objects = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            objects[doc["kind"]] = doc
    return objects


def pod_container(objects: dict[str, dict]) -> dict:
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def container_env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[:-len(suffix)]) * factor)
    return int(quantity)


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        clean = pattern.lstrip("!").strip("/")
        if clean.startswith("**/"):
            hit = any(fnmatch.fnmatch(c.split("/")[-1], clean[3:]) for c in candidates)
        else:
            hit = any(fnmatch.fnmatch(c, clean) for c in candidates)
        if hit:
            excluded = not negated
    return excluded
