"""`petal tfrecords`: images to sharded TFRecords with Apache Beam, the counterpart of the recipe's
jpeg_to_tf_record.py.

Converting once up front is what lets training read big sequential files in parallel instead of decoding CSVs
and opening millions of small files every epoch. The job runs on the DirectRunner by default; every flag it does
not know is handed to Beam unchanged, so the same job runs on Dataflow, Flink or Spark
(`--runner DataflowRunner --project P --region R --temp_location gs://... --setup_file ./setup.py`).

Inputs (`--train`, `--eval`) are either a CSV of `path,label` rows without a header (relative paths are resolved
against the CSV's own folder, absolute paths and URLs such as gs:// are used as they are) or a folder with one
subfolder per class. Outputs in `--output_dir`: `train-00000-of-0000N` and `eval-...` shards of tf.train.Example
(features listed in `example`), `labels.txt`, and `errors.jsonl` with one JSON line (split, path, label, reason)
for every row that could not be converted. Bad rows never fail the job, and for each split the rows read always
equal the records written plus the errors.
"""
import argparse
import csv
import io
import json
import logging
import os
import posixpath
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import apache_beam as beam
import tensorflow as tf
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.runner import PipelineResult
from PIL import Image, UnidentifiedImageError

from exported_models.model_format import LABELS_FILE, read_labels
from training import PROGRESS_LOGGER

log = logging.getLogger(__name__)
progress = logging.getLogger(PROGRESS_LOGGER)  # INFO even when quiet: see petal.configure_logging

NAMESPACE = "petal.tfrecords"
SPLITS = ("train", "eval")
ERRORS_FILE = "errors.jsonl"
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"
REENCODE_QUALITY = 95
PROGRESS_EVERY = 500
ERRORS_TAG = "errors"


@dataclass(frozen=True)
class Row:
    """One input row: where the image is and what the input says it shows."""

    path: str
    label: str


class RowError(Exception):
    """A row that cannot become a record; its message is the reason written to the errors file."""


def is_url(path: str) -> bool:
    return "://" in path


def resolve(path: str, base_dir: str) -> str:
    """A CSV path relative to the CSV's folder; absolute paths and URLs stay as they are."""
    if is_url(path) or posixpath.isabs(path) or not base_dir:
        return path
    return FileSystems.join(base_dir, path)


def parse_csv_line(line: str, base_dir: str) -> Row:
    """A `path,label` line to a Row; a malformed line becomes a Row whose label marks it for the errors file."""
    fields = next(csv.reader([line]), [])
    if len(fields) != 2 or not fields[0].strip():
        return Row(path=line, label="")
    return Row(path=resolve(fields[0].strip(), base_dir), label=fields[1].strip())


def list_class_folders(folder: str) -> list[Row]:
    """Every file below `folder/<class>/`, labelled with its folder's name, in a stable order."""
    pattern = FileSystems.join(folder, "*", "*")
    paths = sorted(meta.path for result in FileSystems.match([pattern]) for meta in result.metadata_list)
    return [Row(path=path, label=posixpath.basename(posixpath.dirname(path))) for path in paths]


def class_folder_labels(folder: str) -> list[str]:
    return sorted({row.label for row in list_class_folders(folder)})


def imageless_class_folders(folder: str) -> list[str]:
    """The subfolders of a local class-folder input that hold no file, which therefore name no label: a class whose
    copy failed left a model of one class fewer, and nothing said so."""
    if is_url(folder):
        return []
    labels = set(class_folder_labels(folder))
    return sorted(name for name in os.listdir(folder)
                  if os.path.isdir(os.path.join(folder, name)) and name not in labels)


def is_folder(path: str) -> bool:
    """A class-folder input (not a CSV): a local directory, or a URL ending in '/'."""
    if is_url(path):
        return path.endswith("/")
    return os.path.isdir(path)


def csv_labels(path: str) -> list[str]:
    """The labels a CSV uses, for when no labels file is given."""
    with FileSystems.open(path) as f:
        lines = io.TextIOWrapper(f, encoding="utf-8").read().splitlines()
    return sorted({parse_csv_line(line, "").label for line in lines if line.strip()} - {""})


def to_rgb(image: Image.Image) -> Image.Image:
    """Any mode to RGB: CMYK and palette convert, transparency goes onto white, 16-bit grey is scaled down."""
    if image.mode.startswith("I"):
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return background
    return image.convert("RGB")


def to_jpeg(data: bytes) -> tuple[bytes, int, int]:
    """Image bytes to (JPEG bytes, height, width). RGB JPEGs pass through byte for byte; everything else that
    decodes is re-encoded as an RGB JPEG. Raises RowError for anything that is not a whole, readable image."""
    if not data:
        raise RowError("empty file")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError:
        raise RowError("not an image: unrecognised file format") from None
    except Image.DecompressionBombError as e:
        raise RowError(f"image too large: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise RowError(f"corrupt image: {e}") from None
    width, height = image.size
    if image.format == "JPEG" and image.mode == "RGB":
        return data, height, width
    buffer = io.BytesIO()
    to_rgb(image).save(buffer, format="JPEG", quality=REENCODE_QUALITY)
    return buffer.getvalue(), height, width


def example(jpeg: bytes, label: int, text: str, filename: str, height: int, width: int) -> tf.train.Example:
    """The record training/preprocessing.py reads (the recipe's feature names)."""
    def bytes_(value: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def int64(value: int) -> tf.train.Feature:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": bytes_(jpeg),
        "image/format": bytes_(b"JPEG"),
        "image/class/label": int64(label),
        "image/class/text": bytes_(text.encode("utf-8")),
        "image/filename": bytes_(filename.encode("utf-8")),
        "image/height": int64(height),
        "image/width": int64(width),
    }))


class ConvertRow(beam.DoFn):
    """Row -> serialized Example, or an error line on the `errors` output. Never raises for bad input."""

    def __init__(self, split: str, labels: Sequence[str]):
        self.split = split
        self.label_ids = {label: i for i, label in enumerate(labels)}
        self.read = Metrics.counter(NAMESPACE, f"{split}_read")
        self.written = Metrics.counter(NAMESPACE, f"{split}_written")
        self.errors = Metrics.counter(NAMESPACE, f"{split}_errors")
        self.seen = 0

    def process(self, row: Row) -> Iterator:
        self.read.inc()
        self.seen += 1
        if self.seen % PROGRESS_EVERY == 0:
            progress.info("tfrecords progress",
                          extra={"fields": {"split": self.split, "rows_in_this_worker": self.seen}})
        try:
            record = self.convert(row)
        except RowError as e:
            self.errors.inc()
            yield beam.pvalue.TaggedOutput(ERRORS_TAG, json.dumps(
                {"split": self.split, "path": row.path, "label": row.label, "reason": str(e)}))
            return
        self.written.inc()
        yield record

    def convert(self, row: Row) -> bytes:
        if not row.label:
            raise RowError("bad CSV row: expected `path,label`")
        if row.label not in self.label_ids:
            raise RowError(f"unknown label {row.label!r}")
        try:
            with FileSystems.open(row.path) as f:
                data = f.read()
        except Exception as e:  # Beam's filesystems raise their own error types for missing or unreadable files.
            if not FileSystems.exists(row.path):
                raise RowError("missing: no such file") from None
            raise RowError(f"unreadable: {e}") from None
        jpeg, height, width = to_jpeg(data)
        return example(jpeg, self.label_ids[row.label], row.label, row.path, height, width).SerializeToString()


def read_rows(pipeline: beam.Pipeline, split: str, source: str) -> beam.PCollection:
    if is_folder(source):
        return pipeline | f"List{split}" >> beam.Create(list_class_folders(source))
    base_dir = posixpath.dirname(source) if is_url(source) else os.path.dirname(os.path.abspath(source))
    return (pipeline
            | f"Read{split}" >> beam.io.ReadFromText(source)
            | f"NonBlank{split}" >> beam.Filter(lambda line: bool(line.strip()))
            | f"Parse{split}" >> beam.Map(parse_csv_line, base_dir))


@dataclass
class Counts:
    read: int
    written: int
    errors: int


def build(pipeline: beam.Pipeline, sources: dict[str, str], labels: list[str], output_dir: str,
          num_shards: dict[str, int]) -> None:
    """The job graph: for each split, rows -> ConvertRow -> shards; the error lines of all splits -> one file."""
    error_lines = []
    for split, source in sources.items():
        converted = (read_rows(pipeline, split, source)
                     | f"Convert{split}" >> beam.ParDo(ConvertRow(split, labels)).with_outputs(ERRORS_TAG,
                                                                                                main="records"))
        _ = converted.records | f"Write{split}" >> beam.io.WriteToTFRecord(
            FileSystems.join(output_dir, split), num_shards=num_shards[split], shard_name_template=SHARD_TEMPLATE)
        error_lines.append(converted[ERRORS_TAG])
    _ = (error_lines | "AllErrors" >> beam.Flatten()
         | "WriteErrors" >> beam.io.WriteToText(FileSystems.join(output_dir, ERRORS_FILE), num_shards=1,
                                                 shard_name_template=""))


def counts(result: PipelineResult, split: str) -> Counts | None:
    """The job's counters for a split, or None on a runner that does not report metrics."""
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    except NotImplementedError:
        return None
    total = {name: 0 for name in ("read", "written", "errors")}
    for metric in found:
        prefix, _, name = metric.key.metric.name.partition("_")
        if prefix == split:
            total[name] += metric.committed if metric.committed is not None else metric.attempted
    return Counts(**total)


def infer_labels(source: str) -> list[str]:
    """Without a labels file: the class folders' names, or the labels the CSV uses, sorted."""
    return class_folder_labels(source) if is_folder(source) else csv_labels(source)


def write_labels(output_dir: str, labels: list[str]) -> None:
    with FileSystems.create(FileSystems.join(output_dir, LABELS_FILE)) as f:
        f.write("".join(f"{label}\n" for label in labels).encode("utf-8"))


def remove_stale_shards(output_dir: str, split: str, num_shards: int) -> None:
    """Shards left by an earlier run with another shard count would otherwise be read together with these."""
    pattern = FileSystems.join(output_dir, f"{split}-?????-of-?????")
    keep = f"-of-{num_shards:05d}"
    stale = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list if not m.path.endswith(keep)]
    if stale:
        log.info("removing stale shards", extra={"fields": {"split": split, "count": len(stale)}})
        FileSystems.delete(stale)


def run(sources: dict[str, str], output_dir: str, labels: list[str], num_shards: dict[str, int],
        beam_args: Sequence[str] = ()) -> dict[str, Counts | None]:
    """Convert each split's source to shards in `output_dir`; returns the counts per split."""
    options = PipelineOptions(list(beam_args))
    standard = options.view_as(StandardOptions)
    standard.runner = standard.runner or "DirectRunner"
    if not is_url(output_dir):
        os.makedirs(output_dir, exist_ok=True)
    write_labels(output_dir, labels)
    log.info("tfrecords starting", extra={"fields": {"runner": standard.runner, "sources": sources,
                                                      "num_labels": len(labels)}})
    pipeline = beam.Pipeline(options=options)
    build(pipeline, sources, labels, output_dir, num_shards)
    result = pipeline.run()
    result.wait_until_finish()
    for split in sources:
        remove_stale_shards(output_dir, split, num_shards[split])
    return {split: counts(result, split) for split in sources}


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="petal tfrecords", description=__doc__.split("\n\n")[0], allow_abbrev=False,  # --labels is Beam's.
        epilog="Flags not listed here go to Apache Beam (e.g. --runner, --project, --temp_location).")
    parser.add_argument("--train", "--train_csv", dest="train",
                        help="training images: a CSV of path,label rows or a folder with one subfolder per class")
    parser.add_argument("--eval", "--eval_csv", "--validation_csv", dest="eval",
                        help="eval images, in the same forms as --train")
    parser.add_argument("--labels_file", help="one label per line, in label-id order (default: the class "
                                              "folders' or the train CSV's labels, sorted)")
    parser.add_argument("--output_dir", required=True, help="local folder or URL (gs://...) for the shards")
    parser.add_argument("--num_shards", type=int, default=4, help="number of train shards")
    parser.add_argument("--eval_num_shards", type=int, help="number of eval shards (default: --num_shards)")
    args, beam_args = parser.parse_known_args(list(argv))
    if not (args.train or args.eval):
        parser.error("give --train and/or --eval")
    if args.num_shards < 1 or (args.eval_num_shards is not None and args.eval_num_shards < 1):
        parser.error("shard counts must be >= 1")
    for source in (args.train, args.eval):
        if source and not is_url(source) and not os.path.exists(source):
            parser.error(f"no such file or folder: {source}")
    return args, beam_args


def main(argv: list[str]) -> int:
    args, beam_args = parse_args(argv)
    sources = {split: source for split, source in zip(SPLITS, (args.train, args.eval), strict=True) if source}
    empty = [source for source in sources.values() if is_folder(source) and not list_class_folders(source)]
    if empty:  # it wrote empty shards with exit 0, which training then repeated for ever
        print(f"petal tfrecords: error: {empty[0]} has no images in class folders ({empty[0]}/<label>/<image>)",
              file=sys.stderr)
        return 2
    try:
        labels = read_labels(args.labels_file) if args.labels_file else infer_labels(next(iter(sources.values())))
    except (OSError, ValueError) as e:
        print(f"petal tfrecords: error: cannot read labels: {e}", file=sys.stderr)
        return 2
    if not labels:
        print("petal tfrecords: error: no labels found; pass --labels_file", file=sys.stderr)
        return 2
    source = next(iter(sources.values()))
    if not args.labels_file and is_folder(source) and (imageless := imageless_class_folders(source)):
        print(f"petal tfrecords: warning: {', '.join(imageless)} in {source} hold no images, so they are no labels; "
              f"the labels are {', '.join(labels)}", file=sys.stderr)
    num_shards = {"train": args.num_shards, "eval": args.eval_num_shards or args.num_shards}
    try:
        results = run(sources, args.output_dir, labels, num_shards, beam_args)
    except ValueError as e:  # Beam's answer to a bad pipeline option, e.g. an unknown --runner.
        print(f"petal tfrecords: error: {e}", file=sys.stderr)
        return 2
    for split, found in results.items():
        if found is None:
            print(f"{split}: this runner reports no counters; see its console")
        else:
            print(f"{split}: read {found.read}, written {found.written}, errors {found.errors}")
    print(f"labels: {FileSystems.join(args.output_dir, LABELS_FILE)} ({len(labels)}); "
          f"errors: {FileSystems.join(args.output_dir, ERRORS_FILE)}")
    return 0
