#!/usr/bin/env bash
# Submits `petal batch --engine=spark` to a cluster with the packaged Petal wheel, in a packed virtualenv that
# YARN, Kubernetes or a standalone cluster unpacks beside every executor (Spark's --archives).
#
#   MASTER=yarn deploy/spark/submit.sh --model_dir gs://B/models/flowers --input 'gs://B/photos/*.jpg' \
#       --output_dir gs://B/predictions/run1 --batch_size 64 --top_k 3
#
# MASTER: yarn (EMR, Dataproc), spark://host:7077, k8s://https://host:443 or local[N]; DEPLOY_MODE: cluster runs
# the driver on the cluster too, client (the default) runs it here. SPARK_SUBMIT: the cluster's spark-submit (Spark
# 3.5 or 4.x; `pip install 'petal[spark]'` brings one). Extra spark-submit flags: SPARK_SUBMIT_ARGS.
set -euo pipefail
cd "$(dirname "$0")/../.."
MASTER=${MASTER:?set MASTER, e.g. yarn or spark://host:7077}
DEPLOY_MODE=${DEPLOY_MODE:-client}
SPARK_SUBMIT=${SPARK_SUBMIT:-spark-submit}
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build/spark}

# 1. The wheel, and a relocatable virtualenv with it and its dependencies (TensorFlow included); the executors
#    take pyspark from the cluster's Spark.
rm -rf "$BUILD" && mkdir -p "$BUILD"
"$PYTHON" -m pip wheel --no-deps -w "$BUILD" .
"$PYTHON" -m venv "$BUILD/env"
"$BUILD/env/bin/pip" install -q "$BUILD"/petal-*.whl venv-pack
"$BUILD/env/bin/venv-pack" -q -p "$BUILD/env" -o "$BUILD/petal-env.tar.gz"

# 2. The job. Executors run ./environment/bin/python from the unpacked archive; in client mode the driver runs
#    the virtualenv built above, in cluster mode the archive's too.
if [ "$DEPLOY_MODE" = cluster ]; then DRIVER_PYTHON=./environment/bin/python; else DRIVER_PYTHON=$BUILD/env/bin/python; fi
PYSPARK_DRIVER_PYTHON=$DRIVER_PYTHON PYSPARK_PYTHON=./environment/bin/python \
  "$SPARK_SUBMIT" --master "$MASTER" --deploy-mode "$DEPLOY_MODE" \
  --archives "$BUILD/petal-env.tar.gz#environment" \
  --conf spark.pyspark.python=./environment/bin/python \
  ${SPARK_SUBMIT_ARGS:-} \
  deploy/spark/petal_batch.py "$@"
