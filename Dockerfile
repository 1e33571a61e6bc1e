# Petal serving image, shaped like tensorflow/serving: models under /models, MODEL_NAME picks one,
# gRPC on 8500, REST on 8501, and any extra `docker run` arguments pass through as server flags.
#
#   docker build -t petal .
#   docker run -p 8500:8500 -p 8501:8501 petal
#   docker run -p 8501:8501 -v /path/to/models:/models -e MODEL_NAME=mymodel petal --workers=2
#
# GPU: BASE_IMAGE is the only switch. Any base whose own packages give Python >= 3.11 and that carries the CUDA and
# cuDNN runtime TensorFlow 2.21 links against (CUDA 12.5+, cuDNN 9.3+, as tensorflow[and-cuda] pins) works:
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 -t petal:gpu .
#   docker run --gpus all -p 8500:8500 -p 8501:8501 petal:gpu
#
# The image installs what `petal serve` needs (no Beam, Locust or TensorBoard), with the object stores' clients
# (PETAL_EXTRAS=cloud: s3fs, gcsfs, adlfs), so MODEL_BASE_PATH may be s3://, gs:// or az:// (docs/deploy.md).
# PETAL_EXTRAS names the optional dependency groups: deploy/docker-compose.yml builds its Locust load generator from
# this same file with PETAL_EXTRAS=loadtest.
ARG BASE_IMAGE=debian:bookworm-slim

# Python from the base's own packages, under every stage below.
FROM ${BASE_IMAGE} AS python
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# Dependencies stage: the virtualenv the image runs, with the dependencies alone. They come from pyproject.toml
# alone, so a change to Petal's code rebuilds only the small layers after them; and the runtime stage starts from
# this one rather than copying the virtualenv's 2 GB out of it, which took 48 s of every rebuild with buildah here.
# pip's cache stays out of the image; TensorFlow's 430 MB of C++ headers only serve custom-op builds: gone.
FROM python AS dependencies
ARG PETAL_EXTRAS="cloud"
COPY pyproject.toml /tmp/petal/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/petal \
    && /opt/petal/bin/python -c "import tomllib; project = tomllib.load(open('/tmp/petal/pyproject.toml', 'rb'))['project']; \
extras = [e for e in '${PETAL_EXTRAS}'.split(',') if e]; \
deps = project['dependencies'] + [d for e in extras for d in project['optional-dependencies'][e]]; \
print('\n'.join(d for d in deps if not d.startswith('petal')))" > /tmp/petal/requirements.txt \
    && /opt/petal/bin/pip install -r /tmp/petal/requirements.txt \
    && rm -rf /opt/petal/lib/python3*/site-packages/tensorflow/include /tmp/petal

# Build stage: a wheel of Petal, which stays here.
FROM dependencies AS build
WORKDIR /src
COPY pyproject.toml README.md petal.py ./
COPY exported_models/__init__.py exported_models/model_format.py exported_models/storage.py exported_models/
COPY exported_models/flowers exported_models/flowers
COPY training training
COPY serving serving
COPY load_tests load_tests
RUN /opt/petal/bin/pip wheel --no-deps --wheel-dir /wheels .

# Runtime stage: the dependencies' virtualenv, Petal installed into it from its wheel, a non-root user and the
# default model.
FROM dependencies
RUN useradd --create-home --uid 10001 --user-group petal
COPY --from=build /wheels /opt/wheels
RUN /opt/petal/bin/pip install --no-cache-dir --no-index --no-deps /opt/wheels/*.whl && rm -rf /opt/wheels
COPY --chown=10001:10001 exported_models/flowers /models/flowers
ENV PATH=/opt/petal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TF_CPP_MIN_LOG_LEVEL=2 \
    MODEL_NAME=flowers \
    MODEL_BASE_PATH=/models
USER 10001:10001
WORKDIR /home/petal
EXPOSE 8500 8501
# Plain HTTP, else HTTPS for a server given --ssl_config_file (unverified: the check asks whether this container is
# ready, not who it is). With client_verify (mutual TLS) override it with one that presents a client certificate.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import ssl, urllib.request as u\ntry: u.urlopen('http://127.0.0.1:8501/readyz', timeout=2)\nexcept OSError: u.urlopen('https://127.0.0.1:8501/readyz', timeout=2, context=ssl._create_unverified_context())"]
# exec replaces the shell, so the server is PID 1 and receives SIGTERM itself to drain in-flight requests.
ENTRYPOINT ["/bin/sh", "-c", "exec petal serve --port=8500 --rest_api_port=8501 --model_name=\"$MODEL_NAME\" \
--model_base_path=\"$MODEL_BASE_PATH/$MODEL_NAME\" \"$@\"", "petal"]
