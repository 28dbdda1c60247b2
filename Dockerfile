# syntax=docker/dockerfile:1
# One image for the three services, run by the package's own command, `cogment-aux`:
#   docker run IMAGE                                   the Directory (services directory)
#   docker run IMAGE services model_registry
#   docker run IMAGE services trial_datastore
#   docker run IMAGE services all                      the three, each in its own process
#   docker run IMAGE migrate --database_url URL
# Configure with the services' environment variables (COGMENT_DIRECTORY_PORT, ...) or flags.
# Build: docker build -t cogment-aux:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: the repository's wheel, installed with its dependencies into a virtual environment ----
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first: this layer is rebuilt only when pyproject.toml changes.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --upgrade pip \
    && pip install -r /tmp/requirements.txt
# The wheel users get from `pip wheel .` (the alembic history inside it), installed as any wheel
# is: the virtual environment holds nothing of the source tree.
COPY README.md ./
COPY shared ./shared
COPY services ./services
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /tmp/wheels . \
    && pip install /tmp/wheels/cogment_aux-*.whl \
    && pip check \
    # From /: what runs must come from the venv. A migrated SQLite file proves the wheel's history.
    && cd / \
    && cogment-aux migrate --database_url sqlite+aiosqlite:////tmp/check.db --log_level warning \
    && rm -rf /tmp/check.db* /tmp/wheels

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
# The services listen on 127.0.0.1 by default; in a container, that is reachable from nowhere.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    COGMENT_DIRECTORY_BIND_ADDRESS=0.0.0.0 \
    COGMENT_MODEL_REGISTRY_BIND_ADDRESS=0.0.0.0 \
    COGMENT_TRIAL_DATASTORE_BIND_ADDRESS=0.0.0.0 \
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
ENTRYPOINT ["cogment-aux"]
CMD ["services", "directory"]
