"""Export a trained classifier as a SavedModel that takes raw image bytes, in TF Serving's layout.

The decode runs inside the graph with the same `preprocess_eval` that evaluation used, so a served prediction can
never disagree with the accuracy measured in training; it decodes a JPEG at the smallest DCT scaling that still
covers the model's input, which the export records for the server's memory budget. The version directory appears
in one rename, so a server polling the base path never loads half a model; on an object store (`s3://`, `gs://`,
`az://`), where there is no rename, the version is exported to a local folder and uploaded with its saved_model.pb
last, the file whose arrival makes a server take the folder for a version.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

from exported_models import model_format, storage
from exported_models.model_format import (
    DEFAULT_MODEL_NAME,
    DEFAULT_SIGNATURE,
    IMAGE_INPUT,
    LABELS_FILE,
    SAVED_MODEL_FILE,
    WarmupRequest,
)
from training.models import ModelConfig
from training.preprocessing import preprocess_eval

log = logging.getLogger(__name__)

MAX_WARMUP_IMAGES = 5
IMMUTABLE = "{} already exists; versions are immutable, pick another --version"


class _Servable(tf.Module):
    """The exported object: the model's variables, the label table and the two signatures.

    The Keras model itself stays out of the object graph: Keras 3 checkpoints each of its variables as a copy of
    its own, which graph loaders (TF Serving's SavedModelBundle, `saved_model_cli run`) restore while the signatures
    read the backend variable, left uninitialized there ("Could not find variable", keras-team/keras#20096). So the
    backend variables are what is tracked and checkpointed, once each.
    """

    def __init__(self, model: keras.Model, labels_path: str, image_size: int):
        super().__init__()
        self.model_variables = [v.value for v in model.variables]
        self.labels = tf.lookup.StaticHashTable(
            tf.lookup.TextFileInitializer(labels_path, tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER,
                                          tf.string, tf.lookup.TextFileIndex.WHOLE_LINE),
            default_value="")
        num_classes = int(model.output_shape[-1])

        def classify(images):
            # An empty batch skips the model: some kernels (oneDNN batch norm) reject a zero batch dimension.
            logits = tf.cond(tf.shape(images)[0] > 0,
                             lambda: tf.cast(model(images, training=False), tf.float32),
                             lambda: tf.zeros([0, num_classes]))
            classid = tf.argmax(logits, axis=1, output_type=tf.int64)
            return {"probabilities": tf.nn.softmax(logits), "classid": classid, "class": self.labels.lookup(classid)}

        def from_bytes(image_bytes):
            images = tf.map_fn(lambda b: preprocess_eval(b, image_size, image_size), image_bytes,
                               fn_output_signature=tf.TensorSpec([image_size, image_size, 3], tf.float32))
            return classify(images)

        self.serving_default = tf.function(
            from_bytes, input_signature=[tf.TensorSpec([None], tf.string, name=IMAGE_INPUT)])
        self.predict_images = tf.function(
            classify, input_signature=[tf.TensorSpec([None, image_size, image_size, 3], tf.float32, name="images")])


def synthetic_jpegs(count: int = 3, size: int = 64) -> list[bytes]:
    """Real JPEG bytes (gradients of different colours) for warmup when the caller has no images at hand."""
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    images = []
    for i in range(count):
        image = np.stack([np.add.outer(ramp, ramp) / 2, np.roll(ramp, 17 * i)[None, :].repeat(size, 0),
                          np.full((size, size), 60.0 * i)], axis=-1)
        images.append(tf.io.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8)).numpy())
    return images


def warmup_requests(images: list[bytes]) -> list[WarmupRequest]:
    """One single-image request per image plus one batch of all, so both batch shapes get compiled."""
    batches = [[image] for image in images] + ([images] if len(images) > 1 else [])
    return [WarmupRequest(DEFAULT_SIGNATURE, {IMAGE_INPUT: np.array(batch, dtype=object)}) for batch in batches]


def export_saved_model(model: keras.Model, export_base: str, labels: list[str], image_size: int,
                       version: int | None = None, warmup_images: list[bytes] | None = None) -> str:
    """Write `<export_base>/<version>/` (a temporary sibling, then one rename) and return its path.

    The model must take NHWC float32 images in [-1, 1] and return logits; the signatures add decoding, softmax,
    argmax and label lookup. The warmup images are run through the exported function before the rename, so a
    model that cannot serve them is never published.
    """
    version = model_format.next_version(export_base) if version is None else int(version)
    final = os.path.join(export_base, str(version))
    if os.path.exists(final):
        raise FileExistsError(IMMUTABLE.format(final))
    os.makedirs(export_base, exist_ok=True)
    warmup_images = warmup_images or synthetic_jpegs()
    staging = tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=export_base)
    try:
        labels_src = os.path.join(staging, "labels_src", LABELS_FILE)
        os.makedirs(os.path.dirname(labels_src))
        model_format.write_labels(labels_src, labels)
        servable = _Servable(model, labels_src, image_size)
        outputs = servable.serving_default(tf.constant(warmup_images))
        if outputs["probabilities"].shape != (len(warmup_images), len(labels)):
            raise ValueError(f"model returned {outputs['probabilities'].shape} for {len(warmup_images)} images "
                             f"and {len(labels)} labels")
        saved = os.path.join(staging, "model")
        tf.saved_model.save(servable, saved, signatures={"serving_default": servable.serving_default,
                                                          "predict_images": servable.predict_images})
        model_format.write_warmup(saved, os.path.basename(export_base.rstrip("/")), warmup_requests(warmup_images))
        model_format.write_scaled_jpeg_inputs(saved, {DEFAULT_SIGNATURE: {IMAGE_INPUT: (image_size, image_size)}})
        os.rename(saved, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported", extra={"fields": {"path": final, "labels": len(labels), "image_size": image_size}})
    return final


def export_to_store(model: keras.Model, export_base: str, labels: list[str], image_size: int,
                    version: int | None = None, warmup_images: list[bytes] | None = None) -> str:
    """`export_saved_model` to a base path on an object store: the version (by default one more than the highest
    integer folder the store lists there) is exported to a local folder, then uploaded with its saved_model.pb
    last, so that a server polling the store never takes a version whose variables are still on their way
    (model_format.versions_in_listing). Returns the version's URL."""
    taken = {int(name) for name in {path.split("/", 1)[0] for path in storage.list_files(export_base) if "/" in path}
             if name.isascii() and name.isdigit()}
    version = max(taken, default=0) + 1 if version is None else int(version)
    final = storage.join(export_base, str(version))
    if version in taken:
        raise FileExistsError(IMMUTABLE.format(final))
    with tempfile.TemporaryDirectory(prefix="petal-export-") as staging:
        folder = export_saved_model(model, os.path.join(staging, os.path.basename(export_base.rstrip("/"))), labels,
                                    image_size, version, warmup_images)
        last = os.path.join(staging, "last")
        os.makedirs(last)
        os.rename(os.path.join(folder, SAVED_MODEL_FILE), os.path.join(last, SAVED_MODEL_FILE))
        storage.upload_tree(folder, final)
        storage.upload_tree(last, final)
    log.info("uploaded", extra={"fields": {"path": final}})
    return final


def restore_for_export(checkpoint_dir: str) -> tuple[keras.Model, ModelConfig]:
    """Rebuild the model a `petal train` output directory describes, with its latest checkpointed weights.

    The model is rebuilt in float32 and NHWC whatever the training used (bf16, transposed input): the weights are
    the same, and serving wants neither.
    """
    config = ModelConfig.load(checkpoint_dir)
    keras.mixed_precision.set_global_policy("float32")
    model = config.build()
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoint_dir}")
    tf.train.Checkpoint(model=model).restore(latest).expect_partial().assert_existing_objects_matched()
    log.info("restored", extra={"fields": {"checkpoint": latest}})
    return model, config


def what_failed(message: str) -> str:
    """A TF error's own words, without what a graph's error puts around them: a heading ("Graph execution error:",
    "Detected at node ...:"), the Python stack where the node was defined and the node's tags, all indented."""
    said = [line for line in message.splitlines() if line and not line[0].isspace() and not line.endswith(":")]
    return said[-1] if said else message


def warmup_image(path: str) -> bytes:
    """A --warmup_images file's bytes, refused with its name unless it is an image the signature decodes (a folder or
    a CSV among the matches was a traceback)."""
    try:
        data = tf.io.gfile.GFile(path, "rb").read()
        tf.io.decode_image(data, channels=3, expand_animations=False)
    except tf.errors.OpError as e:
        raise ValueError(f"--warmup_images: {path}: {what_failed(e.message)}") from None
    return data


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="petal export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", required=True, help="the --output_dir of `petal train`")
    parser.add_argument("--export_dir", required=True,
                        help="writes <export_dir>/<model_name>/<version>/: a local path or a URL (s3://, gs://, az://)")
    parser.add_argument("--model_name", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--version", type=int, default=None, help="default: one more than the highest existing")
    parser.add_argument("--warmup_images", default=None,
                        help="glob of a few image files for the warmup requests (default: generated JPEGs)")
    args = parser.parse_args(argv)
    if args.version is not None and args.version <= 0:
        parser.error(f"--version must be a positive integer (TF Serving's <model_name>/<version>/), got {args.version}")
    try:
        storage.require(args.export_dir)  # a store whose package is missing is said before the model is restored
        warmup = None
        if args.warmup_images:
            files = sorted(tf.io.gfile.glob(args.warmup_images))[:MAX_WARMUP_IMAGES]
            if not files:
                raise FileNotFoundError(f"no files match --warmup_images {args.warmup_images!r}")
            warmup = [warmup_image(f) for f in files]
        model, config = restore_for_export(args.checkpoint_dir)
        export = export_to_store if storage.is_remote(args.export_dir) else export_saved_model
        path = export(model, storage.join(args.export_dir, args.model_name), list(config.labels), config.image_size,
                      version=args.version, warmup_images=warmup)
    except (OSError, ValueError) as e:  # a missing checkpoint, a version that exists, a path under a file
        print(f"petal export: {e}", file=sys.stderr)
        return 1
    except tf.errors.OpError as e:  # a damaged checkpoint
        print(f"petal export: {what_failed(e.message)}", file=sys.stderr)
        return 1
    print(path)
    return 0
