"""Batch prediction jobs on Apache Beam, the batched TPU path: `petal batch` (job), its input formats (sources) and
its RunInference model handler (model_handler). Install with `pip install 'petal[batch]'`."""
