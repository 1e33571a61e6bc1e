"""The file spark-submit runs: `petal batch --engine=spark` with spark-submit's master, executors and settings.

    spark-submit [spark-submit flags] deploy/spark/petal_batch.py --model_dir M --input 'P' --output_dir O ...

Petal must be importable where the driver and the executors run (see deploy/spark/README.md).
"""
import sys

import petal

if __name__ == "__main__":
    sys.exit(petal.main(["batch", "--engine=spark", *sys.argv[1:]]))
