# syntax=docker/dockerfile:1
# One runtime image for every hivekeeper role (backbone, trainer, auxiliary, monitor) and for
# the operator. Its entrypoint is `hivekeeper`; pods of the operator run `hivekeeper-operator`,
# swarm pods `python -m hivekeeper_operator.launch` (which execs `hivekeeper run ROLE ...`).
#
#   CPU (default):  docker build -t hivekeeper:0.3.0 .
#   CUDA:           docker build -t hivekeeper:0.3.0-cu128 \
#                     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   Without docker: cluster/image/build.sh (buildah on a Debian base of its own, from the
#                   wheelhouse scripts/install.sh fills: nothing is downloaded twice).
#
# Layers, slowest first: Python + venv, torch, the dependencies pinned in pyproject.toml, and
# last the source, so that a change under services/ or operator/ rebuilds only the last one, and
# a change to pyproject.toml that leaves its dependencies alone (the requirements stage) none.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE} AS python-torch

# torch comes from PyTorch's own index: PyPI's Linux wheel is a multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# A builder may lend a wheelhouse for the build only: every requirement as a wheel, mounted at
# this path; pip then installs from it alone (--no-index), e.g. cluster/image/build.sh runs
# buildah with `--volume ~/.cache/hivekeeper/wheels:/wheels:ro --build-arg WHEELHOUSE=/wheels`.
ARG WHEELHOUSE

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
    && if [ -z "$WHEELHOUSE" ]; then pip install --upgrade pip; fi

RUN groupadd --gid 10001 hivekeeper \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin hivekeeper

RUN if [ -n "$WHEELHOUSE" ]; then index="--no-index --find-links $WHEELHOUSE"; \
    else index="--index-url $TORCH_INDEX_URL"; fi \
    && pip install $index "torch==${TORCH_VERSION}"

# The dependencies, read from pyproject.toml by scripts/requirements.py (the list install.sh
# fills the wheelhouse from): the build backend, [project] dependencies and the operator extra;
# only this list reaches the image's next layers.
FROM python-torch AS requirements
COPY pyproject.toml /tmp/
COPY scripts/requirements.py /tmp/scripts/
RUN python3 /tmp/scripts/requirements.py operator > /tmp/requirements.txt

# torch==X is already met by X+cpu. hivemind from its wheel only: the sdist would download p2pd
# at build time.
FROM python-torch
ARG WHEELHOUSE
COPY --from=requirements /tmp/requirements.txt /tmp/
RUN if [ -n "$WHEELHOUSE" ]; then index="--no-index --find-links $WHEELHOUSE"; else index=""; fi \
    && pip install $index --only-binary=hivemind -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The source: no resolver, no download, no build isolation (everything is installed above).
WORKDIR /src
COPY pyproject.toml README.m[d] LICENSE ./
COPY services ./services
COPY operator ./operator
RUN pip install --no-deps --no-build-isolation . \
    && cd / && rm -rf /src \
    && pip check \
    && hivekeeper --version && hivekeeper-operator --help >/dev/null

# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /tmp
EXPOSE 31337 9300 8080
ENTRYPOINT ["hivekeeper"]
CMD ["--help"]
