# syntax=docker/dockerfile:1
# One runtime image for every hivekeeper role (backbone, trainer, auxiliary, monitor) and for
# the operator. Its entrypoint is `hivekeeper`; pods of the operator run `hivekeeper-operator`,
# swarm pods `python -m hivekeeper_operator.launch` (which execs `hivekeeper run ROLE ...`).
#
#   CPU (default):  docker build -t hivekeeper:0.1.0 .
#   CUDA:           docker build -t hivekeeper:0.1.0-cu128 \
#                     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# torch comes from PyTorch's own index: PyPI's Linux wheel is a multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV VIRTUAL_ENV=/opt/hivekeeper \
    PATH=/opt/hivekeeper/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

# A CUDA base has no Python; the python image has one.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

# hivemind from its wheel only: the sdist would download p2pd at build time.
WORKDIR /src
COPY pyproject.toml README.m[d] ./
COPY services ./services
COPY operator ./operator
RUN pip install --only-binary=hivemind ".[operator]" \
    && cd / && rm -rf /src \
    && hivekeeper --version && hivekeeper-operator --help >/dev/null

RUN groupadd --gid 10001 hivekeeper \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin hivekeeper

# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /tmp
EXPOSE 31337 9300 8080
ENTRYPOINT ["hivekeeper"]
CMD ["--help"]
