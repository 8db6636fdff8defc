# syntax=docker/dockerfile:1
# Orchestrator: the CPU service (DAG, prompt rendering, token counting, tool
# calls). No ML libraries: deploy/requirements/orchestrator.txt has none.
#
# Build from the repository root:
#   docker build -f deploy/docker/orchestrator.Dockerfile -t switchyard-orchestrator .
#
# Base images are pinned by exact tag. For a release, pin the digest too:
#   FROM python:3.11.13-slim-bookworm@sha256:<digest>   (docker buildx imagetools inspect <tag>)

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Locked third-party packages first: this layer is reused while only the code changes.
COPY deploy/requirements/orchestrator.txt /tmp/requirements.txt
RUN pip install --no-cache-dir --no-deps --requirement /tmp/requirements.txt
COPY pyproject.toml README.md /src/
# services/ alone: the harness (harness/, package switchyard_harness) is not part of an image.
COPY services /src/services
# pip check: every installed package, switchyard included, has its dependencies.
RUN pip install --no-cache-dir --no-deps /src \
 && pip check

FROM python:3.11.13-slim-bookworm
RUN groupadd --system --gid 10001 switchyard \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin switchyard \
 && install -d -o 10001 -g 10001 /app
COPY --from=build /opt/venv /opt/venv
# The shipped config/, unchanged; what a container needs differently comes from SWITCHYARD_* variables.
COPY config /etc/switchyard
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SWITCHYARD_CONFIG_DIR=/etc/switchyard \
    SWITCHYARD_HOST=0.0.0.0
WORKDIR /app
USER 10001:10001
# gRPC, Prometheus metrics, the HTTP face
EXPOSE 50051 9101 8080
ENTRYPOINT ["switchyard", "serve", "orchestrator"]
