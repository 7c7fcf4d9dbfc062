# fp8forge service image: CUDA PyTorch, TransformerEngine and torchao; runs `fp8forge serve` under tini.
#   docker build -t fp8forge .
#   docker run --gpus all --stop-timeout 30 -p 8000:8000 -v fp8forge-data:/data fp8forge
#   docker logs <container>    # the first start on a fresh volume prints the admin API key, once
# The base must carry a torch that satisfies pyproject.toml (>=2.13,<2.15) and nvcc (the -devel flavour)
# for TransformerEngine's PyTorch extension; override BASE_IMAGE to pin another CUDA build.
# TE_VERSION pins TransformerEngine's release line: the TE backend was checked against 2.20, and TE changes
# its PyTorch API between minor releases, so move the pin only after running the TE tests on a GPU.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}
ARG TE_VERSION=2.20

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FP8FORGE_DATA_DIR=/data \
    FP8FORGE_HF_CACHE=/data/hf-cache \
    FP8FORGE_ALLOWED_MODEL_ROOTS=/models

# tini as PID 1: it forwards SIGTERM to `fp8forge serve` (which requeues running jobs) and reaps the worker
# and conversion processes that end, so `docker stop` is a clean shutdown, not a kill after the timeout.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# TransformerEngine builds against the torch already in the image (hence no build isolation).
RUN python -m pip install --no-build-isolation "transformer_engine[pytorch]==${TE_VERSION}.*"

WORKDIR /opt/fp8forge
COPY pyproject.toml README.md ./
COPY converters ./converters
COPY service ./service
COPY tools/prune_torchao_kernels.py ./tools/
# torch comes from the base image; pip keeps it because it satisfies the range. torchao is pinned there; its
# kernels built for another CPython (the wheel's cp310 MXFP8 one) are removed, or every start would print a
# failure to load them. TE is only located, not imported: importing it needs the CUDA driver, which a build lacks.
RUN python -m pip install . \
    && python tools/prune_torchao_kernels.py \
    && python -c "import torch, torchao, transformers, service.cli.serve" \
    && python -c "import importlib.util as u; assert u.find_spec('transformer_engine'), 'TE missing'"

RUN useradd --create-home --uid 10001 fp8forge \
    && mkdir -p /data /models \
    && chown fp8forge:fp8forge /data /models
USER fp8forge
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)" \
        || exit 1

# Workers default to one per visible GPU (one CPU worker without GPUs); FP8FORGE_WORKERS overrides.
# A shutdown takes up to ~20 s (graceful HTTP wait, cancel grace, workers requeueing their jobs): run with
# `--stop-timeout 30` so Docker does not SIGKILL it first.
# API keys are on (the server listens on 0.0.0.0). On a fresh /data volume with no key (no /data/api_keys, no
# FP8FORGE_API_KEYS), --first-key creates an admin key "admin" and prints it once to the container's log
# (`docker logs`); later starts find it. Keys of your own: `docker run --rm -v fp8forge-data:/data fp8forge
# fp8forge keys create NAME`, or -e FP8FORGE_API_KEYS=NAME:user:<sha256 of the token> (docs/service.md, Docker).
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["fp8forge", "serve", "--host", "0.0.0.0", "--port", "8000", "--first-key", "admin"]
