# syntax=docker/dockerfile:1
# Dispatcher: the GPU service (inference queue, double-buffered batching,
# scheduler, engine). Based on the NVIDIA CUDA runtime image; carries
# [dispatcher,torch]: NVML bindings and CUDA torch.
#
# Build from the repository root:
#   docker build -f deploy/docker/dispatcher.Dockerfile -t switchyard-dispatcher .
#
# Python is Ubuntu 24.04's python3 (3.12); deploy/requirements/dispatcher.txt is
# derived for 3.12. The Linux x86_64 wheel of torch 2.13.0 is the CUDA 13.0 build:
# it brings the CUDA runtime, cuDNN and NCCL as pip packages pinned exactly in its
# own metadata, so this install resolves dependencies (then checks them) where the
# CPU images install with --no-deps. The base image's CUDA 13.0 matches it: the
# container runtime refuses to start it on a driver too old for CUDA 13 (R580+).
#
# Base images are pinned by exact tag. For a release, pin the digest too:
#   FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:<digest>   (docker buildx imagetools inspect <tag>)

FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive
# The release's python3 is pinned by the base image tag (Ubuntu 24.04).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/requirements/dispatcher.txt /tmp/requirements.txt
RUN pip install --no-cache-dir --requirement /tmp/requirements.txt
COPY pyproject.toml README.md /src/
# services/ alone: the harness (harness/, package switchyard_harness) is not part of an image.
COPY services /src/services
# pip check: every installed package, switchyard included, has its dependencies.
RUN pip install --no-cache-dir --no-deps /src \
 && pip check

FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 switchyard \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin switchyard \
 && install -d -o 10001 -g 10001 /app
COPY --from=build /opt/venv /opt/venv
# The shipped config/, unchanged; what a container needs differently comes from SWITCHYARD_* variables.
COPY config /etc/switchyard
# Caches go to /tmp (an emptyDir in Kubernetes: the root filesystem is read-only).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SWITCHYARD_CONFIG_DIR=/etc/switchyard \
    SWITCHYARD_HOST=0.0.0.0 \
    XDG_CACHE_HOME=/tmp/.cache \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
USER 10001:10001
# gRPC, Prometheus metrics
EXPOSE 50053 9103
ENTRYPOINT ["switchyard", "serve", "dispatcher"]
