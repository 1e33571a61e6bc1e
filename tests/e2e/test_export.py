"""export_saved_model: layout, signatures, round trip against the in-memory model, bad bytes, versions."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image
from tensorflow_serving.apis import prediction_log_pb2

from exported_models import model_format
from exported_models.model_format import next_version
from serving.core.servable import Servable
from serving.metrics import Metrics
from training.export import export_saved_model
from training.models import build_model
from training.preprocessing import preprocess_eval, scale
from training.synth import CLASSES, render

SIZE = 32
LABELS = list(CLASSES)
BIN = os.path.dirname(sys.executable)

# Runs in a fresh interpreter that never imports Petal: a served model must not need our code.
LOAD_AND_PREDICT = """
import json, sys, tensorflow as tf
assert not any(m.startswith("training") for m in sys.modules)
model = tf.saved_model.load(sys.argv[1])
images = [open(p, "rb").read() for p in sys.argv[2:]]
out = model.signatures["serving_default"](image_bytes=tf.constant(images))
print(json.dumps({k: v.numpy().tolist() if k != "class" else [c.decode() for c in v.numpy()]
                  for k, v in out.items()}))
"""


@pytest.fixture(scope="module")
def jpegs():
    return [render(label, seed=100 + label, size=(48 + 8 * label, 40)) for label in range(5)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, jpegs):
    """A compact model with trained-looking (non-uniform) weights, exported once for the module."""
    tf.keras.utils.set_random_seed(3)
    model = build_model("compact", len(LABELS), SIZE)
    model.get_layer("logits").bias.assign(np.linspace(-1, 1, len(LABELS)).astype("float32"))
    base = str(tmp_path_factory.mktemp("models") / "flowers")
    path = export_saved_model(model, base, LABELS, SIZE, warmup_images=jpegs[:3])
    return model, path


def test_layout_is_tf_servings(exported):
    _, path = exported
    assert os.path.basename(path) == "1"
    assert sorted(os.listdir(os.path.dirname(path))) == ["1"], "no temporary directory may be left behind"
    for name in ("saved_model.pb", "variables/variables.index", "assets/labels.txt",
                 "assets.extra/tf_serving_warmup_requests", model_format.SCALED_JPEG_FILE):
        assert os.path.exists(os.path.join(path, name)), name
    with open(os.path.join(path, "assets", "labels.txt")) as f:
        assert f.read().splitlines() == LABELS
    assert sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) < 5 * 2**20


def test_reloaded_model_matches_the_in_memory_model_in_a_fresh_process(exported, jpegs, tmp_path):
    model, path = exported
    files = []
    for i, jpeg in enumerate(jpegs):
        files.append(str(tmp_path / f"{i}.jpg"))
        with open(files[-1], "wb") as f:
            f.write(jpeg)
    run = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, path, *files], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])
    images = tf.stack([preprocess_eval(j, SIZE, SIZE) for j in jpegs])
    expected = tf.nn.softmax(model(images, training=False)).numpy()
    np.testing.assert_allclose(served["probabilities"], expected, rtol=1e-4, atol=1e-5)
    assert served["classid"] == expected.argmax(axis=1).tolist()
    assert served["class"] == [LABELS[i] for i in served["classid"]]


def test_signatures_and_dtypes(exported, jpegs):
    _, path = exported
    loaded = tf.saved_model.load(path)
    assert set(loaded.signatures) == {"serving_default", "predict_images"}
    default, images_sig = loaded.signatures["serving_default"], loaded.signatures["predict_images"]
    assert default.structured_input_signature[1] == {
        "image_bytes": tf.TensorSpec([None], tf.string, name="image_bytes")}
    assert images_sig.structured_input_signature[1] == {
        "images": tf.TensorSpec([None, SIZE, SIZE, 3], tf.float32, name="images")}
    for signature in (default, images_sig):
        outputs = signature.structured_outputs
        assert outputs["probabilities"].dtype == tf.float32 and outputs["probabilities"].shape.as_list() == [None, 5]
        assert outputs["classid"].dtype == tf.int64 and outputs["class"].dtype == tf.string
    from_bytes = default(image_bytes=tf.constant(jpegs))
    from_images = images_sig(images=tf.stack([preprocess_eval(j, SIZE, SIZE) for j in jpegs]))
    np.testing.assert_allclose(from_bytes["probabilities"], from_images["probabilities"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tf.reduce_sum(from_bytes["probabilities"], axis=1), 1.0, rtol=1e-5)
    assert default(image_bytes=tf.constant([], tf.string))["probabilities"].shape == (0, 5)


def test_png_gif_and_bmp_bytes_are_accepted(exported):
    _, path = exported
    image = tf.cast(tf.random.stateless_uniform([20, 30, 3], [1, 2], maxval=255), tf.uint8)
    encoded = [tf.io.encode_png(image).numpy(), tf.io.encode_jpeg(image).numpy()]
    for fmt in ("GIF", "BMP"):
        buffer = io.BytesIO()
        Image.fromarray(image.numpy()).save(buffer, format=fmt)
        encoded.append(buffer.getvalue())
    out = tf.saved_model.load(path).signatures["serving_default"](image_bytes=tf.constant(encoded))
    assert out["probabilities"].shape == (4, 5)


def test_a_jpeg_decodes_at_the_smallest_dct_scaling_that_covers_the_input_and_the_export_says_so(exported):
    """A 1024x768 photo decodes at 1/8 for a 32x32 model (128x96), as the server's memory budget is told to charge
    it; a PNG of it still classifies, decoded in full."""
    model, path = exported
    photo = render("roses", 5, size=(1024, 768))
    served = tf.saved_model.load(path).signatures["serving_default"](image_bytes=tf.constant([photo]))
    for ratio, same in ((8, True), (1, False)):
        decoded = tf.io.decode_jpeg(photo, channels=3, ratio=ratio)
        expected = tf.nn.softmax(model(scale(tf.image.resize(decoded, [SIZE, SIZE]) / 255.0)[None], training=False))
        assert np.allclose(served["probabilities"], expected, rtol=1e-4, atol=1e-5) == same, ratio
    assert model_format.scaled_jpeg_inputs(path) == {"serving_default": {"image_bytes": (SIZE, SIZE)}}
    assert Servable("flowers", 1, path).scaled_jpeg_inputs == {"serving_default": {"image_bytes": (SIZE, SIZE)}}
    png = tf.io.encode_png(tf.io.decode_jpeg(photo)).numpy()
    assert tf.saved_model.load(path).signatures["serving_default"](image_bytes=tf.constant([png]))[
        "probabilities"].shape == (1, len(LABELS))


def test_saved_model_cli_lists_both_signatures(exported):
    _, path = exported
    run = subprocess.run([os.path.join(BIN, "saved_model_cli"), "show", "--all", "--dir", path],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "signature_def['serving_default']" in run.stdout and "signature_def['predict_images']" in run.stdout
    assert "inputs['image_bytes'] tensor_info:\n        dtype: DT_STRING\n        shape: (-1)" in run.stdout
    assert f"inputs['images'] tensor_info:\n        dtype: DT_FLOAT\n        shape: (-1, {SIZE}, {SIZE}, 3)" \
        in run.stdout
    assert "outputs['classid'] tensor_info:\n        dtype: DT_INT64" in run.stdout


def saved_model_cli_probabilities(path: str, images: list[bytes], folder) -> np.ndarray:
    """`saved_model_cli run`'s answer: it loads the SavedModel as TF Serving's SavedModelBundle does (the graph in
    a Session, the variables restored by the saver's restore op), not as tf.saved_model.load does."""
    inputs = str(folder / "images.npy")
    np.save(inputs, np.array(images, dtype=object))
    run = subprocess.run([os.path.join(BIN, "saved_model_cli"), "run", "--dir", path, "--tag_set", "serve",
                          "--signature_def", "serving_default", "--inputs", f"image_bytes={inputs}"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert run.returncode == 0, run.stderr[-2000:]
    printed = run.stdout.split("Result for output key probabilities:\n", 1)[1].split("Result for", 1)[0]
    return np.array(json.loads(" ".join(printed.split()).replace(" ", ",").replace("[,", "[").replace(",]", "]")))


@pytest.mark.parametrize("model", ["fresh export", "shipped default model"])
def test_a_graph_loader_restores_every_variable_the_signature_reads(model, exported, jpegs, tmp_path):
    """Keras 3 checkpoints a model's variables as copies that a graph loader restores while the signature reads
    the originals ("Could not find variable" in TF Serving, keras-team/keras#20096): the export tracks the
    originals."""
    path = exported[1] if model == "fresh export" else os.path.join(model_format.DEFAULT_MODEL_BASE_PATH, "1")
    expected = tf.saved_model.load(path).signatures["serving_default"](image_bytes=tf.constant(jpegs))
    np.testing.assert_allclose(saved_model_cli_probabilities(path, jpegs, tmp_path), expected["probabilities"],
                               rtol=1e-4, atol=1e-5)


def test_undecodable_bytes_raise_invalid_argument_and_the_model_keeps_working(exported, jpegs):
    _, path = exported
    serve = tf.saved_model.load(path).signatures["serving_default"]
    for bad in (b"not an image", jpegs[0][:40], b""):
        with pytest.raises(tf.errors.InvalidArgumentError):
            serve(image_bytes=tf.constant([jpegs[1], bad]))
    assert serve(image_bytes=tf.constant([jpegs[1]]))["classid"].shape == (1,)


def test_warmup_requests_are_prediction_logs_of_real_images(exported, jpegs):
    _, path = exported
    records = list(tf.data.TFRecordDataset(os.path.join(path, "assets.extra", "tf_serving_warmup_requests")))
    logs = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in records]
    assert len(logs) == 4  # three single images and one batch of all three
    batch_sizes = []
    for entry in logs:
        request = entry.predict_log.request
        assert request.model_spec.name == "flowers" and request.model_spec.signature_name == "serving_default"
        images = tf.make_ndarray(request.inputs["image_bytes"])
        batch_sizes.append(len(images))
        assert all(bytes(image) in jpegs for image in images)
    assert batch_sizes == [1, 1, 1, 3]


def test_the_server_replays_the_warmup_file_the_exporter_wrote(exported, jpegs):
    """One definition of the warmup file: what export writes is what model_format reads and a servable replays."""
    _, path = exported
    assert os.path.isfile(os.path.join(path, model_format.WARMUP_FILE))
    requests = list(model_format.read_warmup(path))
    assert [len(r.inputs["image_bytes"]) for r in requests] == [1, 1, 1, 3]
    assert all(r.signature_name == model_format.DEFAULT_SIGNATURE for r in requests)
    assert Servable("flowers", 1, path).warmup(Metrics()) == 4


def test_versions_count_up_and_are_never_overwritten(tmp_path):
    base = str(tmp_path / "m")
    model = build_model("compact", 2, SIZE)
    assert next_version(base) == 1
    os.makedirs(os.path.join(base, "7"))
    os.makedirs(os.path.join(base, "not-a-version"))
    path = export_saved_model(model, base, ["a", "b"], SIZE)
    assert path == os.path.join(base, "8")
    with pytest.raises(FileExistsError, match="immutable"):
        export_saved_model(model, base, ["a", "b"], SIZE, version=8)
    with pytest.raises(ValueError, match="labels"):
        export_saved_model(model, base, ["a", ""], SIZE, version=9)
    with pytest.raises(ValueError, match="2 labels|3 labels"):
        export_saved_model(model, base, ["a", "b", "c"], SIZE, version=10)
    assert sorted(os.listdir(base)) == ["7", "8", "not-a-version"]
