# Petal serving image, shaped like tensorflow/serving: models under /models, MODEL_NAME picks one,
# gRPC on 8500, REST on 8501, and any extra `docker run` arguments pass through as server flags.
#
#   docker build -t petal .
#   docker run -p 8500:8500 -p 8501:8501 petal
#   docker run -p 8501:8501 -v /path/to/models:/models -e MODEL_NAME=mymodel petal --workers=2
#
# GPU: BASE_IMAGE is the only switch. Any base with Python >= 3.11 from its own packages and the CUDA/cuDNN
# runtime that TensorFlow 2.21 was built against works, e.g.
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.5.1-cudnn-runtime-ubuntu24.04 -t petal:gpu .
#   docker run --gpus all -p 8500:8500 -p 8501:8501 petal:gpu
ARG BASE_IMAGE=debian:bookworm-slim

# Build stage: compilers, pip and wheel caches stay here and never reach the runtime image.
FROM ${BASE_IMAGE} AS build
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/petal
WORKDIR /src
# Dependencies first, from the project metadata alone, so a code change does not re-download TensorFlow.
COPY pyproject.toml README.md petal.py ./
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/petal/bin/pip wheel --wheel-dir /wheels . \
    && /opt/petal/bin/pip install --no-index --find-links /wheels petal
COPY training training
COPY serving serving
RUN /opt/petal/bin/pip wheel --no-deps --wheel-dir /wheels/petal . \
    && /opt/petal/bin/pip install --no-deps --force-reinstall /wheels/petal/petal-*.whl

# Runtime stage: the base plus Debian's python3, the finished virtualenv and the default model.
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group petal
COPY --from=build /opt/petal /opt/petal
COPY --chown=10001:10001 exported_models/flowers /models/flowers
ENV PATH=/opt/petal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TF_CPP_MIN_LOG_LEVEL=2 \
    MODEL_NAME=flowers \
    MODEL_BASE_PATH=/models
USER 10001:10001
WORKDIR /home/petal
EXPOSE 8500 8501
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8501/readyz', timeout=2)"]
# exec replaces the shell, so the server is PID 1 and receives SIGTERM itself to drain in-flight requests.
ENTRYPOINT ["/bin/sh", "-c", "exec petal serve --port=8500 --rest_api_port=8501 --model_name=\"$MODEL_NAME\" --model_base_path=\"$MODEL_BASE_PATH/$MODEL_NAME\" \"$@\"", "petal"]
