"""`petal loadtest`: Locust load tests against latency SLOs, and a capacity sweep that finds the knee.

Locust runs in a subprocess (`python -m locust`), never in this process: importing Locust monkey-patches
everything with gevent, and its own CSV and HTML reports come for free. This module makes the image corpus,
optionally starts `petal serve`, runs Locust headless, and judges Locust's final stats with load_tests.slo.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from exported_models import DEFAULT_MODEL_BASE_PATH, DEFAULT_MODEL_NAME
from load_tests import launcher, sweep
from load_tests.slo import (
    ENDPOINTS,
    SLO,
    TOTAL,
    Breach,
    EndpointStats,
    SLOError,
    check,
    load_slo,
    parse_weights,
    read_locust_stats,
)
from serving.client.security import TOKEN_ENV, Security

log = logging.getLogger(__name__)

# Shipped as package data beside this module, so an installed Petal finds them from any working directory.
DEFAULT_LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DEFAULT_SLO = Path(__file__).with_name("slo.toml")
DEFAULT_IMAGE_SIZES = "96x96,320x240,1024x768,2048x1536"
SERVER_STOP_GRACE_S = 10  # the run is over: a short grace, then no reason to wait for a slow drain
LOCUST_GRACE_S = 90  # start-up (the gRPC user imports TensorFlow) and shutdown on top of --run-time


class LoadTestError(Exception):
    """The load test could not run (no server, Locust crashed): a failure, never a pass."""


@dataclass(frozen=True)
class Target:
    host: str
    grpc_host: str


@dataclass(frozen=True)
class Settings:
    """What every Locust run of one invocation shares."""

    target: Target
    model_name: str
    images: Path
    weights: dict[str, int]
    spawn_rate: float | None
    run_time_s: int
    locustfile: Path
    request_timeout_s: float
    security: Security = Security()


def locust_flags(security: Security) -> list[str]:
    """The TLS files as Locust's flags. The token is left out: it reaches Locust as $PETAL_TOKEN, never on a
    command line `ps` shows."""
    return [arg for name in ("ca_file", "cert_file", "key_file") if getattr(security, name)
            for arg in (f"--{name.replace('_', '-')}", getattr(security, name))]


def parse_duration(text: str) -> int:
    """Locust's `--run-time` syntax (`20`, `20s`, `1m30s`, `1h`) to seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s?)?", text.strip())
    if not text.strip() or not match:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 20s, 1m30s, 1h")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total < 1:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be at least 1s")
    return total


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)x(\d+)", part)
        if not match or not all(16 <= int(v) <= 8192 for v in match.groups()):
            raise argparse.ArgumentTypeError(f"bad image size {part!r}: use WIDTHxHEIGHT, 16..8192 px each")
        sizes.append((int(match[1]), int(match[2])))
    if not sizes:
        raise argparse.ArgumentTypeError("no image sizes given")
    return sizes


def make_corpus(folder: Path, sizes: list[tuple[int, int]]) -> Path:
    """One synthetic flower per class at each size (thumbnails to multi-megapixel), so latency reflects real
    decode and resize costs. Deterministic, so files already there are reused rather than redrawn."""
    from training.synth import CLASSES, render

    folder.mkdir(parents=True, exist_ok=True)
    for width, height in sizes:
        for label, name in enumerate(CLASSES):
            path = folder / f"{name}_{width}x{height}.jpg"
            if not path.exists():
                path.write_bytes(render(label, seed=1000 + label, size=(width, height)))
    return folder


def _model_available(host: str, model_name: str, security: Security) -> bool:
    request = urllib.request.Request(f"{host}/v1/models/{model_name}", headers=security.header())
    context = security.ssl_context() if host.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            states = [v.get("state") for v in json.load(response).get("model_version_status", [])]
    except (OSError, ValueError):
        return False
    return "AVAILABLE" in states


@contextlib.contextmanager
def running_server(model_base_path: Path, model_name: str, log_path: Path, extra_flags: list[str],
                   timeout_s: float, security: Security = Security()) -> Iterator[Target]:
    """`petal serve` on free loopback ports (load_tests.launcher) until the block ends; ready means the model reports
    AVAILABLE (after its warmup), so the first measured requests do not pay for loading."""
    if not model_base_path.is_dir() or not any(p.name.isdigit() for p in model_base_path.iterdir()):
        raise LoadTestError(f"no model versions under {model_base_path}: train and export one first "
                            "(petal train, petal export) or pass --model_base_path")
    flags = [f"--model_name={model_name}", f"--model_base_path={model_base_path}", *extra_flags]
    try:
        with launcher.running(flags, ready=lambda server: _model_available(server.rest_url, model_name, security),
                              log_path=str(log_path), timeout_s=timeout_s, stop_timeout_s=SERVER_STOP_GRACE_S,
                              tls=any(flag.startswith("--ssl_config_file") for flag in extra_flags)) as server:
            yield Target(server.rest_url, server.grpc_target)
    except launcher.ServerStartError as error:
        raise LoadTestError(f"server did not start: {error}") from None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_locust(settings: Settings, users: int, out_dir: Path) -> dict[str, EndpointStats]:
    """One headless Locust run; leaves locust_stats.json (judged), Locust's CSVs, report.html and locust.log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = ",".join(f"{name}={w}" for name, w in settings.weights.items() if w > 0)
    command = [sys.executable, "-m", "locust", "-f", str(settings.locustfile), "--headless", "--only-summary",
               "--host", settings.target.host, "--users", str(users),
               "--spawn-rate", str(settings.spawn_rate or users), "--run-time", f"{settings.run_time_s}s",
               "--csv", str(out_dir / "locust"), "--html", str(out_dir / "report.html"),
               "--json-file", str(out_dir / "locust_stats"),
               "--loglevel", "WARNING", "--images", str(settings.images), "--model-name", settings.model_name,
               "--grpc-host", settings.target.grpc_host, "--weights", weights,
               "--request-timeout", str(settings.request_timeout_s), *locust_flags(settings.security)]
    log_path = out_dir / "locust.log"
    log.info("running locust", extra={"fields": {"command": shlex.join(command)}})
    print(f"loadtest: {users} user(s) for {settings.run_time_s}s against {settings.target.host}"
          f" ({weights}); Locust log {log_path}", file=sys.stderr, flush=True)
    stats_json = out_dir / "locust_stats.json"
    stats_json.unlink(missing_ok=True)
    with open(log_path, "wb") as locust_log:
        try:
            # Locust exits 1 whenever any request failed; the SLO check, not that, decides pass or fail.
            subprocess.run(command, stdout=locust_log, stderr=subprocess.STDOUT,
                           timeout=settings.run_time_s + LOCUST_GRACE_S,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: settings.security.token or ""})
        except subprocess.TimeoutExpired:
            raise LoadTestError(f"locust did not finish within {settings.run_time_s + LOCUST_GRACE_S}s;"
                                f" log {log_path}:\n{_tail(log_path)}") from None
    if not stats_json.exists():
        raise LoadTestError(f"locust wrote no stats; log {log_path}:\n{_tail(log_path)}")
    return read_locust_stats(stats_json)


def stats_dict(stats: EndpointStats) -> dict:
    return {"requests": stats.requests, "failures": stats.failures, "failure_ratio": round(stats.failure_ratio, 4),
            "rps": round(stats.rps, 3), "p50_ms": stats.p50_ms, "p95_ms": stats.p95_ms, "p99_ms": stats.p99_ms}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(stats: dict[str, EndpointStats], breaches: list[Breach]) -> str:
    """The run's numbers per endpoint, then all traffic, with the SLO verdict of each row."""
    breached = {b.endpoint for b in breaches}
    lines = [f"{'endpoint':<22}{'requests':>9}{'fail %':>8}{'req/s':>9}{'p50 ms':>8}{'p95 ms':>8}{'p99 ms':>8}"
             "  SLO"]
    rows = [name for name in ENDPOINTS if name in stats] + [TOTAL]
    for name in rows:
        row = stats[name]
        verdict = "BREACH" if name in breached or (name == TOTAL and "total" in breached) else "ok"
        label = "total" if name == TOTAL else name
        lines.append(f"{label:<22}{row.requests:>9}{100 * row.failure_ratio:>8.2f}{row.rps:>9.2f}"
                     f"{_ms(row.p50_ms):>8}{_ms(row.p95_ms):>8}{_ms(row.p99_ms):>8}  {verdict}")
    return "\n".join(lines)


def _report_failure(breaches: list[Breach]) -> None:
    print(f"loadtest FAILED: {len(breaches)} SLO breach(es):", file=sys.stderr)
    for breach in breaches:
        print(f"  - {breach}", file=sys.stderr)


def single_run(settings: Settings, slo: SLO, users: int, report_dir: Path, summary: dict) -> int:
    stats = run_locust(settings, users, report_dir)
    breaches = check(slo, stats, settings.weights)
    summary.update(endpoints={name: stats_dict(s) for name, s in stats.items() if name != TOTAL},
                   total=stats_dict(stats[TOTAL]), breaches=[str(b) for b in breaches], passed=not breaches,
                   reports={"json": str(report_dir / "locust_stats.json"), "csv": str(report_dir / "locust_stats.csv"),
                            "html": str(report_dir / "report.html")})
    print(format_table(stats, breaches))
    if breaches:
        _report_failure(breaches)
        return 1
    print(f"loadtest passed: every SLO met; reports in {report_dir}")
    return 0


def _p95_limit(slo: SLO, weights: dict[str, int]) -> float | None:
    """The p95 line to draw: the all-traffic limit, else the strictest limit of the endpoints with traffic."""
    if slo.total.p95_ms is not None:
        return slo.total.p95_ms
    limits = [slo.endpoints[n].p95_ms for n, w in weights.items() if w > 0 and n in slo.endpoints]
    return min((v for v in limits if v is not None), default=None)


def sweep_run(settings: Settings, slo: SLO, levels: list[int], report_dir: Path, summary: dict) -> int:
    """Step the users up until a level misses the SLO (beyond it more users only queue longer)."""
    results: list[sweep.Level] = []
    print(f"{'users':>6}{'req/s':>9}{'p50 ms':>8}{'p95 ms':>8}{'p99 ms':>8}{'fail %':>8}  SLO", flush=True)
    for users in levels:
        stats = run_locust(settings, users, report_dir / f"users_{users:03d}")
        level = sweep.Level.from_stats(users, stats, check(slo, stats, settings.weights, sweep.KNEE_METRICS))
        results.append(level)
        print(f"{users:>6}{level.rps:>9.2f}{_ms(level.p50_ms):>8}{_ms(level.p95_ms):>8}{_ms(level.p99_ms):>8}"
              f"{100 * level.failure_ratio:>8.2f}  {'ok' if level.meets_slo else 'BREACH'}", flush=True)
        if not level.meets_slo:
            break
    knee = sweep.find_knee(results)
    png = report_dir / "sweep.png"
    sweep.plot(results, knee, _p95_limit(slo, settings.weights), png,
               f"{settings.model_name}: latency vs throughput ({settings.run_time_s}s per level)")
    summary.update(levels=[level.as_dict() for level in results], knee=knee.as_dict() if knee else None,
                   plot=str(png), passed=knee is not None)
    if knee is None:
        _report_failure([Breach(TOTAL, "knee", f"no level met the SLO; at {results[0].users} user(s): {b}")
                         for b in results[0].breaches])
        return 1
    print(f"knee: {knee.rps:.2f} req/s at {knee.users} user(s), p95 {_ms(knee.p95_ms)} ms; plot {png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="petal loadtest", description=__doc__.split("\n\n")[0])

    def flag(name: str, **kwargs) -> None:
        """Both spellings: Locust's dashes and tensorflow_model_server's underscores."""
        names = dict.fromkeys([f"--{name}", f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"])
        parser.add_argument(*names, dest=name.replace("-", "_"), **kwargs)

    flag("host", default="http://127.0.0.1:8501", help="REST base URL of the deployment")
    flag("grpc-host", default="127.0.0.1:8500", help="host:port of its gRPC endpoint")
    flag("model_name", default=DEFAULT_MODEL_NAME, help="model to send requests to")
    flag("users", type=int, default=4, help="concurrent users (closed loop, no think time)")
    flag("spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    flag("run-time", type=parse_duration, default=60, help="how long to run, e.g. 20s, 5m (per level with --sweep)")
    flag("slo", type=Path, default=DEFAULT_SLO, help="SLO file (TOML, see load_tests/slo.toml)")
    flag("weights", default="", help="NAME=N,... traffic mix; overrides the SLO file's weights")
    flag("report_dir", type=Path, default=Path("runs/loadtest"), help="where reports and the summary go")
    flag("images", type=Path, default=None, help="folder of images to send (default: a synthetic corpus)")
    flag("image_sizes", type=parse_sizes, default=parse_sizes(DEFAULT_IMAGE_SIZES),
         help=f"synthetic corpus sizes, WxH,... (default {DEFAULT_IMAGE_SIZES})")
    flag("request_timeout", type=float, default=60.0, help="seconds before a request counts as failed")
    flag("start-server", action="store_true", help="start `petal serve` on free loopback ports for the run")
    flag("model_base_path", type=Path, default=Path(DEFAULT_MODEL_BASE_PATH),
         help="model served by --start-server")
    flag("server_flags", default="", help="extra `petal serve` flags for --start-server, e.g. '--enable_batching'")
    flag("server_timeout", type=float, default=180.0, help="seconds --start-server waits for the model")
    flag("sweep", action="store_true", help="step --sweep_users for --run-time each and report the knee")
    flag("sweep_users", default="1,2,4,8,16,32,64", help="user counts the sweep steps through")
    flag("locustfile", type=Path, default=DEFAULT_LOCUSTFILE, help="Locust users to run (default: Petal's)")
    flag("token", default=os.environ.get(TOKEN_ENV, ""),
         help=f"bearer token for a server with --auth_token_file (default: ${TOKEN_ENV})")
    flag("ca_file", default="", help="TLS: the CA (PEM) that signed the server's certificate; use an https:// --host")
    flag("cert_file", default="", help="TLS: client certificate (PEM) for a server with client_verify")
    flag("key_file", default="", help="TLS: its private key (PEM)")
    return parser


def main(argv: list[str]) -> int:
    if importlib.util.find_spec("locust") is None:  # Locust runs in a subprocess, so no import fails here first
        print("petal loadtest needs locust, which a plain install leaves out: pip install 'petal[loadtest]'",
              file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slo = load_slo(args.slo)
        weights = parse_weights(args.weights) if args.weights else slo.weights
        levels = sweep.parse_levels(args.sweep_users) if args.sweep else []
    except (SLOError, ValueError) as exc:
        parser.error(str(exc))
    # Locust hands whole users to endpoints, so fewer users than endpoints leaves some endpoint without traffic.
    active = sum(1 for w in weights.values() if w > 0)
    if not args.sweep and args.users < active:
        parser.error(f"--users {args.users} is fewer than the {active} endpoints with traffic; raise it or narrow"
                     " --weights")
    if args.sweep and levels[-1] < active:
        parser.error(f"--sweep_users {args.sweep_users}: every level is below the {active} endpoints with traffic")
    if args.sweep and levels[0] < active:
        print(f"sweep: skipping levels below {active} users, one per endpoint with traffic", file=sys.stderr)
        levels = [n for n in levels if n >= active]
    if args.images and not args.images.is_dir():
        parser.error(f"--images {args.images}: not a folder")
    if not args.host.startswith(("http://", "https://")):  # Locust ran, and every REST request failed
        parser.error(f"--host {args.host}: the REST base URL, with its scheme (http://{args.host})")
    report_dir: Path = args.report_dir.resolve()
    report_dir.mkdir(parents=True, exist_ok=True)
    images = args.images.resolve() if args.images else make_corpus(report_dir / "corpus", args.image_sizes)
    summary: dict = {"mode": "sweep" if args.sweep else "run", "slo": str(args.slo), "weights": weights,
                     "users": levels or args.users, "run_time_s": args.run_time, "images": str(images)}
    security = Security(args.token, ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
    try:
        with contextlib.ExitStack() as stack:
            target = Target(args.host.rstrip("/"), args.grpc_host)
            if args.start_server:
                target = stack.enter_context(running_server(
                    args.model_base_path.resolve(), args.model_name, report_dir / "server.log",
                    shlex.split(args.server_flags), args.server_timeout, security))
            summary.update(host=target.host, grpc_host=target.grpc_host)
            settings = Settings(target, args.model_name, images, weights, args.spawn_rate, args.run_time,
                                args.locustfile.resolve(), args.request_timeout, security)
            if args.sweep:
                code = sweep_run(settings, slo, levels, report_dir, summary)
            else:
                code = single_run(settings, slo, args.users, report_dir, summary)
    except LoadTestError as exc:
        summary.update(passed=False, error=str(exc))
        print(f"loadtest FAILED: {exc}", file=sys.stderr)
        code = 1
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return code
