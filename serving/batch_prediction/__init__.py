"""Batch prediction jobs on Apache Beam or Apache Spark, the batched TPU path: `petal batch` (cli), the engine-free
steps, the driver's checks (preflight), the Beam job (job, sources, model_handler) and the Spark job (spark_job on the
driver, spark_tasks on the executors). Install with `pip install 'petal[batch]'` or `'petal[spark]'`.

Importing this package imports TensorFlow without Keras, unless either is imported already. TensorFlow imports
Keras eagerly when it is installed (to register Keras' optimizers for SavedModels that hold them, which a batch job
never loads); that costs every worker about a second and tens of MB at start. A worker of either engine imports this
package before anything else of Petal (it unpickles Petal's functions), so this is the one place that reaches them
all; `petal batch` itself blocks Keras for the whole driver (petal.py). The block lasts only for TensorFlow's own
import (a module set to None in sys.modules makes an import fail, which TensorFlow expects of an absent Keras), so
code that does want Keras later still gets it (docs/batch.md, 'Lean workers'). TensorFlow comes without the C++
start-up lines that TF_CPP_MIN_LOG_LEVEL asks to hide, as on the driver: a Spark executor's Python worker printed
them to the job's terminal, twice.
"""
import sys

from serving.tensorflow_logs import import_tensorflow

if "tensorflow" not in sys.modules and "keras" not in sys.modules:
    sys.modules["keras"] = None  # type: ignore[assignment]
    try:
        import_tensorflow()
    finally:
        del sys.modules["keras"]
