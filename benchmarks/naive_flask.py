"""The baseline users write by hand: a Flask route that calls the SavedModel's signature once per request.

No batching, no model repository: `python benchmarks/naive_flask.py MODEL_DIR PORT` serves
POST /v1/models/flowers:predict with TF Serving's {"instances": [{"b64": ...}]} body under gunicorn (gthread),
the same process model Petal uses, so the comparison isolates Petal's design rather than the web server.

`python benchmarks/naive_flask.py --floor PORT` serves the same route with no model, on Petal's own front end
(serving/process/gevent_worker.py): it reads and decodes the body and answers a constant of the naive route's shape.
That is the least a REST predict can cost in this stack (gunicorn, Flask, one JSON body in and out), which
benchmarks/serving.py adds to the model's CPU for the most images/s the cores allow.
"""
from __future__ import annotations

import base64
import json
import os
import sys

import flask
from gunicorn.app.base import BaseApplication


def create_app(model_dir: str) -> flask.Flask:
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # first, without TensorFlow's C++ start-up lines
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


# An answer of the naive route's size for one image: five classes' probabilities, as TensorFlow's floats print.
FLOOR_ANSWER = json.dumps({"predictions": [{"class": "daisy", "probabilities": [0.12345678901234567] * 5}]})


def create_floor_app() -> flask.Flask:
    app = flask.Flask("floor")

    @app.post("/v1/models/flowers:predict")
    def predict():
        images = [base64.b64decode(i["b64"]) for i in json.loads(flask.request.get_data())["instances"]]
        if not all(images):
            flask.abort(400)
        return flask.Response(FLOOR_ANSWER, content_type="application/json")

    @app.get("/healthz")
    def healthz():
        return {"status": "live"}
    return app


class _App(BaseApplication):
    def __init__(self, model_dir: str | None, port: int):
        self.model_dir, self.port = model_dir, port
        super().__init__()

    def load_config(self):
        front_end = ({"worker_class": "gthread", "threads": 32} if self.model_dir else
                     {"worker_class": "serving.process.gevent_worker.PetalGeventWorker"})
        for key, value in {"bind": [f"127.0.0.1:{self.port}"], "workers": 1, "loglevel": "warning",
                           **front_end}.items():
            self.cfg.set(key, value)

    def load(self):
        return create_app(self.model_dir) if self.model_dir else create_floor_app()


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # Petal's, not benchmarks/serving.py
    _App(None if sys.argv[1] == "--floor" else sys.argv[1], int(sys.argv[2])).run()
