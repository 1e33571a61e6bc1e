"""Checks for the container smoke test (smoke.sh): the image's config, and the server running inside it.

The served answers are compared with the same SavedModel loaded in this process, so the test proves the container
serves the model that was copied into it, whatever that model's accuracy. Exits non-zero with a one-line reason on
the first failed check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

REST_PORT = "8501"
GRPC_PORT = "8500"
NON_ROOT_UID = "10001"


class CheckFailed(Exception):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def check_config(config: dict) -> None:
    """The image must behave like tensorflow/serving's: same ports, env, non-root, a health check on /readyz."""
    user = config.get("User", "")
    expect(user.split(":")[0] == NON_ROOT_UID, f"image runs as {user!r}, expected uid {NON_ROOT_UID}")
    ports = set(config.get("ExposedPorts") or {})
    expect({f"{GRPC_PORT}/tcp", f"{REST_PORT}/tcp"} <= ports, f"exposed ports {sorted(ports)}")
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    expect(env.get("MODEL_NAME") == "flowers" and env.get("MODEL_BASE_PATH") == "/models", f"env {env}")
    health = (config.get("Healthcheck") or {}).get("Test") or []
    expect(health[:1] == ["CMD"] and any("/readyz" in arg for arg in health), f"healthcheck {health}")
    entrypoint = " ".join(config.get("Entrypoint") or [])
    expect("exec petal serve" in entrypoint and '"$@"' in entrypoint, f"entrypoint {entrypoint!r}")


def argv_of(config: dict, which: str) -> list[str]:
    """The command line smoke.sh runs for the entrypoint or the health check, as the image declares it."""
    if which == "entrypoint":
        return list(config["Entrypoint"])
    return list(config["Healthcheck"]["Test"][1:])


def request(url: str, data: bytes | None = None, content_type: str | None = None,
            timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type} if content_type else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def wait_ready(base: str, runner_pid: int, timeout: float) -> float:
    """Seconds until /readyz answers 200; fails at once if the container's process has died."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            os.kill(runner_pid, 0)
        except ProcessLookupError:
            raise CheckFailed("the container's server exited before it became ready") from None
        try:
            if request(f"{base}/readyz", timeout=2)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise CheckFailed(f"/readyz not 200 after {timeout:.0f}s")


def json_body(status: int, body: bytes, expected: int, what: str) -> dict:
    expect(status == expected, f"{what}: HTTP {status}, expected {expected}: {body[:300]!r}")
    try:
        return json.loads(body)
    except ValueError:
        raise CheckFailed(f"{what}: body is not JSON: {body[:300]!r}") from None


def local_top(model_dir: str, images: list[bytes]) -> tuple[str, list[str], list[tuple[str, float]]]:
    """The newest version under model_dir, its labels and its top (label, score) per image, computed here."""
    import tensorflow as tf

    version = max((d for d in os.listdir(model_dir) if d.isdigit()), key=int)
    path = os.path.join(model_dir, version)
    with open(os.path.join(path, "assets", "labels.txt")) as f:
        labels = [line.rstrip("\n") for line in f if line.strip()]
    outputs = tf.saved_model.load(path).signatures["serving_default"](image_bytes=tf.constant(images))
    probabilities = outputs["probabilities"].numpy()
    return version, labels, [(labels[row.argmax()], float(row.max())) for row in probabilities]


def check_serving(base: str, model: str, model_dir: str, runner_pid: int, timeout: float) -> None:
    from training import synth

    print(f"ready after {wait_ready(base, runner_pid, timeout):.1f}s", file=sys.stderr)
    expect(request(f"{base}/healthz")[0] == 200, "/healthz is not 200")
    truth = list(synth.CLASSES)
    images = [synth.render(label, seed=8000 + i, min_size=64, max_size=160) for i, label in enumerate(truth)]
    version, labels, expected = local_top(model_dir, images)
    correct = 0
    for label, image, (top_label, top_score) in zip(truth, images, expected, strict=False):
        answer = json_body(*request(f"{base}/v1/models/{model}:classify_image", image, "image/jpeg"), 200,
                           f"classify {label}")
        expect(answer.get("model") == model and str(answer.get("version")) == version,
               f"answer names {answer.get('model')!r} v{answer.get('version')!r}, expected {model!r} v{version}")
        predictions = answer.get("predictions") or []
        expect(1 <= len(predictions) <= len(labels), f"{len(predictions)} predictions for {len(labels)} labels")
        scores = [p["score"] for p in predictions]
        expect(all(p["label"] in labels for p in predictions), f"unknown labels in {predictions}")
        expect(scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores), f"scores {scores}")
        expect(predictions[0]["label"] == top_label and abs(scores[0] - top_score) < 1e-4,
               f"container says {predictions[0]}, the same SavedModel here says {top_label} {top_score:.5f}")
        correct += predictions[0]["label"] == label
    print(f"classify_image matches the local SavedModel on {len(images)} JPEGs; "
          f"{correct}/{len(images)} are the drawn class", file=sys.stderr)
    error = json_body(*request(f"{base}/v1/models/{model}:classify_image", b"not a jpeg", "image/jpeg"), 400,
                      "undecodable body")
    expect(isinstance(error.get("error"), str) and error["error"], f"400 without an error message: {error}")
    missing = json_body(*request(f"{base}/v1/models/no_such_model:classify_image", images[0], "image/jpeg"), 404,
                        "unknown model")
    expect("error" in missing, f"404 without an error message: {missing}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="check the image config (`buildah inspect --type image` on stdin)")
    config.add_argument("--argv", choices=["entrypoint", "healthcheck"],
                        help="after checking, print this command line NUL-separated for bash")
    serve = commands.add_parser("serve", help="check the running container over HTTP")
    serve.add_argument("--url", required=True)
    serve.add_argument("--model", default="flowers")
    serve.add_argument("--model_dir", required=True, help="the model base path that was copied into the image")
    serve.add_argument("--runner_pid", type=int, required=True)
    serve.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args(argv)
    try:
        if args.command == "config":
            try:
                image_config = json.load(sys.stdin)["Docker"]["config"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckFailed(f"stdin is not `buildah inspect --type image` output: {error!r}") from None
            check_config(image_config)
            if args.argv:
                sys.stdout.write("\0".join(argv_of(image_config, args.argv)) + "\0")
        else:
            check_serving(args.url.rstrip("/"), args.model, args.model_dir, args.runner_pid, args.timeout)
    except CheckFailed as failure:
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
