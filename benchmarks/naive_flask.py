"""The baseline users write by hand: a Flask route that calls the SavedModel's signature once per request.

No batching, no model repository: `python benchmarks/naive_flask.py MODEL_DIR PORT` serves
POST /v1/models/flowers:predict with TF Serving's {"instances": [{"b64": ...}]} body under gunicorn (gthread),
the same process model Petal uses, so the comparison isolates Petal's design rather than the web server.
"""
from __future__ import annotations

import base64
import sys

import flask
from gunicorn.app.base import BaseApplication


def create_app(model_dir: str) -> flask.Flask:
    import tensorflow as tf

    signature = tf.saved_model.load(model_dir).signatures["serving_default"]
    app = flask.Flask("naive")

    @app.post("/v1/models/flowers:predict")
    def predict():
        images = [base64.b64decode(i["b64"]) for i in flask.request.get_json()["instances"]]
        outputs = signature(image_bytes=tf.constant(images))
        return {"predictions": [{"class": c.decode(), "probabilities": p}
                                for c, p in zip(outputs["class"].numpy().tolist(),
                                                outputs["probabilities"].numpy().tolist(), strict=True)]}

    @app.get("/healthz")
    def healthz():
        return {"status": "live"}
    return app


class _App(BaseApplication):
    def __init__(self, model_dir: str, port: int):
        self.model_dir, self.port = model_dir, port
        super().__init__()

    def load_config(self):
        for key, value in {"bind": [f"127.0.0.1:{self.port}"], "workers": 1, "worker_class": "gthread",
                           "threads": 32, "loglevel": "warning"}.items():
            self.cfg.set(key, value)

    def load(self):
        return create_app(self.model_dir)


if __name__ == "__main__":
    _App(sys.argv[1], int(sys.argv[2])).run()
