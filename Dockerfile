# urc: the gateway and the emulated worker in one image (the torch engine: add `.[torch]`).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY third_party third_party
COPY core core
COPY router router
COPY backends backends
COPY simulation simulation
COPY loadgen loadgen
COPY urc urc
RUN pip install --no-cache-dir '.[k8s]'  # k8s: lightkube, for --discover k8s
EXPOSE 8000 9000 5557 5558
CMD ["urc", "--help"]
