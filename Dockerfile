# urc: the gateway, `urc epp` and the emulated worker in one image (the torch engine: add
# `torch` to URC_EXTRAS). Two stages: the builder compiles the wheel (gcc; mypy per
# [build-system]) into a virtualenv, the runtime copies that virtualenv and has no compiler.
#
# `docker run -p 8000:8000 urc` serves a whole local cluster: the gateway on 0.0.0.0:8000 in
# front of 4 emulated GPU workers (`urc cluster`), for any OpenAI client at
# http://localhost:8000/v1. docker-compose.yml and deploy/kubernetes/ run their own commands
# (a gateway, workers, urc epp) with this image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/urc
ENV PATH=/opt/urc/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY third_party third_party
COPY core core
COPY router router
COPY backends backends
COPY simulation simulation
COPY loadgen loadgen
COPY urc urc
# k8s: --discover k8s (lightkube); epp: urc epp (deploy/kubernetes/inference-extension);
# otel: --otel-endpoint (OpenTelemetry traces)
ARG URC_EXTRAS=k8s,epp,otel
# then, from outside the source tree, the build must have compiled (docs/compiled.md)
RUN pip install --no-cache-dir ".[${URC_EXTRAS}]" \
    && cd / && python -c "import core.native as n, sys; sys.exit(not n.compiled())"

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 urc \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin urc
COPY --from=builder /opt/urc /opt/urc
COPY LICENSE /usr/share/doc/urc/LICENSE
ENV PATH=/opt/urc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    URC_HEALTH_URL=http://127.0.0.1:8000/health/live
USER 10001:10001
WORKDIR /home/urc
EXPOSE 8000 9000 5557 5558
# liveness of what CMD serves (the gateway's port); a command serving elsewhere sets
# URC_HEALTH_URL (a worker: http://127.0.0.1:9000/health)
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['URC_HEALTH_URL'], timeout=2)"]
CMD ["urc", "cluster", "--workers", "4", "--host", "0.0.0.0", "--port", "8000"]
