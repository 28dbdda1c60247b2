# syntax=docker/dockerfile:1
# One image for the three services, chosen by the command:
#   docker run IMAGE services.directory        (the default)
#   docker run IMAGE services.model_registry
#   docker run IMAGE services.datastore
#   docker run IMAGE shared.migrate --database_url URL
# Configure with the services' environment variables (COGMENT_DIRECTORY_PORT, ...) or flags.
# Build: docker build -t cogment-aux:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: a virtual environment holding the package and its dependencies ----
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first: this layer is rebuilt only when pyproject.toml changes.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt
RUN pip install --upgrade pip setuptools wheel && pip install -r /tmp/requirements.txt
COPY shared ./shared
COPY services ./services
COPY migrations ./migrations
RUN pip install --no-deps . \
    # shared.db looks for migrations/ beside the shared package: put it there.
    && site=$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
    && cp -r migrations "$site/migrations" \
    && python -m compileall -q "$site/migrations" \
    && python -c 'import services.directory.service, services.model_registry.service, services.datastore.service, shared.migrate'

# ---- runtime: the virtual environment on a clean base, run as a non-root user ----
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="cogment-aux" \
      org.opencontainers.image.description="Cogment 2.x auxiliary services: Directory, Model Registry, Trial Datastore" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 cogment \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /data --shell /usr/sbin/nologin cogment \
    && mkdir -p /data \
    && chown 10001:10001 /data
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    COGMENT_DIRECTORY_DATA_DIR=/data \
    COGMENT_MODEL_REGISTRY_DATA_DIR=/data \
    COGMENT_TRIAL_DATASTORE_DATA_DIR=/data \
    COGMENT_DATA_DIR=/data \
    COGMENT_LOG_FORMAT=json
# The embedded SQLite databases and the registry's local blob store (unused with PostgreSQL and S3).
VOLUME ["/data"]
WORKDIR /data
EXPOSE 9005 9002 9003
USER 10001:10001
ENTRYPOINT ["python", "-m"]
CMD ["services.directory"]
