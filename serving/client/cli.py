"""`petal predict IMAGE...`: classify images with a server (REST or gRPC) or, without --server, in-process
with the exported SavedModel, and print a top-k table.

In-process runs the same `serving_default` signature the server runs, so both paths give the same answer;
it is the quickest check that an export works before anything is deployed. Only that path loads TensorFlow
(serving/client/local.py); over REST the client starts in a fraction of the time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from exported_models import DEFAULT_MODEL_BASE_PATH, DEFAULT_MODEL_NAME
from serving.client import TOKEN_ENV, Client, PetalError, Prediction, RequestError, Security
from serving.tensorflow_logs import import_tensorflow


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="petal predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (JPEG, PNG, ...)")
    parser.add_argument("--server", help="host:port of a server (REST port, or gRPC port with --grpc); "
                                         "without it the model runs in-process")
    parser.add_argument("--grpc", action="store_true", help="talk gRPC (TF Serving's Classify) to --server")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="model name on the server")
    parser.add_argument("--model_version", type=int, help="model version on the server (default: latest)")
    parser.add_argument("--model_base_path", default=DEFAULT_MODEL_BASE_PATH,
                        help="in-process: a SavedModel version directory, or a base path (latest version)")
    parser.add_argument("--top_k", type=int, default=3, help="classes to show per image")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request, retries included")
    parser.add_argument("--format", choices=["table", "json"], default="table",
                        help="a table, or one JSON object per image")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"bearer token for a server with --auth_token_file (default: ${TOKEN_ENV}; the "
                        "variable keeps it out of the process list)")
    parser.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    parser.add_argument("--ca_file", help="TLS, trusting this CA (PEM)")
    parser.add_argument("--cert_file", help="client certificate (PEM) for a server with client_verify")
    parser.add_argument("--key_file", help="its private key (PEM)")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error("--top_k must be at least 1")
    if args.grpc and not args.server:
        parser.error("--grpc needs --server")
    return args


def predict_remote(images: Sequence[bytes], args: argparse.Namespace) -> list[Prediction | str]:
    """One request for all images; if the server refuses it, ask per image so each error names its image."""
    security = Security(args.token, args.tls, args.ca_file, args.cert_file, args.key_file)
    with Client(args.server, use_grpc=args.grpc, model=args.model, version=args.model_version,
                timeout=args.timeout, security=security) as client:
        try:
            return list(client.predict(images, top_k=args.top_k))
        except RequestError as batch_error:
            if len(images) == 1:
                return [str(batch_error)]
        results: list[Prediction | str] = []
        for image in images:
            try:
                results.extend(client.predict([image], top_k=args.top_k))
            except RequestError as err:
                results.append(str(err))
        return results


def render(paths: Sequence[str], results: Sequence[Prediction | str], fmt: str) -> str:
    if fmt == "json":
        return "\n".join(json.dumps({"image": path, "error": result} if isinstance(result, str) else
                                    {"image": path, "predictions": [{"label": label, "score": score}
                                                                    for label, score in result.top_k]})
                         for path, result in zip(paths, results, strict=False))
    rows = [("IMAGE", "RANK", "LABEL", "SCORE")]
    for path, result in zip(paths, results, strict=False):
        if isinstance(result, str):
            rows.append((path, "-", "error", result))
        else:
            rows += [(path, str(rank), label, f"{score:.4f}") for rank, (label, score) in enumerate(result.top_k, 1)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip() for a, b, c, d in rows)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    images = []
    for path in args.images:
        try:
            with open(path, "rb") as f:
                images.append(f.read())
        except OSError as err:
            print(f"petal predict: cannot read {path}: {err.strerror}", file=sys.stderr)
            return 2
    try:
        if args.server:
            results = predict_remote(images, args)
        else:
            import_tensorflow()  # only for the in-process path, and first, without its start-up lines
            from serving.client.local import predict_in_process

            results = predict_in_process(images, args.model_base_path, args.top_k)
    except FileNotFoundError as err:
        print(f"petal predict: {err}; train and export a model, or pass --server", file=sys.stderr)
        return 1
    except (OSError, ValueError, PetalError) as err:
        print(f"petal predict: {err}", file=sys.stderr)
        return 1
    print(render(args.images, results, args.format))
    return 1 if any(isinstance(r, str) for r in results) else 0
