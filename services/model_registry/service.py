"""The Model Registry service: its options and its life cycle on the shared server bootstrap."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc

from services.model_registry import metrics
from services.model_registry.blobstore import BlobStore, BlobStoreError, LocalBlobStore, S3BlobStore
from services.model_registry.core import ModelRegistry
from services.model_registry.servicer import add_servicers
from services.model_registry.store import RegistryStore
from shared.api import directory_pb2
from shared.config import Option, non_negative_int, parse_bool
from shared.db import Database
from shared.dependencies import Dependency
from shared.errors import StartupError
from shared.logging import get_logger
from shared.notify import ChangeFeed
from shared.registration import RegistrationSettings, registration_options
from shared.runtime import ServiceRuntime
from shared.server import Service
from shared.settings import ServerSettings, server_options

DEFAULT_PORT = 9002
ENV_PREFIX = "COGMENT_MODEL_REGISTRY"
CHANGE_CHANNEL = "cogment_model_registry"
# gRPC clients (the SDK among them) refuse messages over 4 MiB by default.
MAX_CHUNK_SIZE = 4 * 1024 * 1024 - 1024


def chunk_size(text: str) -> int:
    value = int(text)
    if not 0 < value <= MAX_CHUNK_SIZE:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_CHUNK_SIZE} bytes (under gRPC's 4 MiB limit)")
    return value


OPTIONS: list[Option] = [
    *server_options(ENV_PREFIX, DEFAULT_PORT),
    Option("archive_dir", "directory of the version data when no S3 endpoint is set "
           "(default: model_registry/ in the data directory)", None, f"{ENV_PREFIX}_ARCHIVE_DIR"),
    Option("cache_max_items", "transient (non-archived) versions kept, least recently used evicted first",
           100, f"{ENV_PREFIX}_VERSION_CACHE_MAX_ITEMS", non_negative_int),
    Option("sent_version_chunk_size", "bytes per RetrieveVersionData message", 2 * 1024 * 1024,
           f"{ENV_PREFIX}_SENT_MODEL_VERSION_DATA_CHUNK_SIZE", chunk_size),
    Option("data_cache_bytes", "memory for the data of hot versions (served without reading the blob "
           "store; versions over a quarter of it are always streamed); 0 turns it off", 256 * 1024 * 1024,
           f"{ENV_PREFIX}_DATA_CACHE_BYTES", non_negative_int),
    Option("s3_endpoint", "host:port of an S3-compatible server for the version data (off when unset)",
           None, f"{ENV_PREFIX}_S3_ENDPOINT"),
    Option("s3_bucket", "bucket of the version data (created if missing)", "cogment-model-registry",
           f"{ENV_PREFIX}_S3_BUCKET"),
    Option("s3_prefix", "prefix of the registry's object keys in the bucket", "", f"{ENV_PREFIX}_S3_PREFIX"),
    Option("s3_access_key", "S3 access key; unset (with the secret key): the credentials AWS's SDKs find, "
           "from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, the shared credentials file, or the role of "
           "the pod or instance", None, f"{ENV_PREFIX}_S3_ACCESS_KEY"),
    Option("s3_secret_key", "S3 secret key (with --s3_access_key)", None, f"{ENV_PREFIX}_S3_SECRET_KEY"),
    Option("s3_region", "S3 region", None, f"{ENV_PREFIX}_S3_REGION"),
    Option("s3_secure", "reach the S3 server over TLS", True, f"{ENV_PREFIX}_S3_SECURE", parse_bool),
    *registration_options("MODEL_REGISTRY"),
]  # fmt: skip


@dataclass(frozen=True)
class ModelRegistrySettings(ServerSettings, RegistrationSettings):
    """The values of OPTIONS."""

    options: ClassVar[Sequence[Option]] = OPTIONS

    archive_dir: str | None
    cache_max_items: int
    sent_version_chunk_size: int
    data_cache_bytes: int
    s3_endpoint: str | None
    s3_bucket: str
    s3_prefix: str
    s3_access_key: str | None
    s3_secret_key: str | None
    s3_region: str | None
    s3_secure: bool


log = get_logger("model_registry")


def blob_store(settings: ModelRegistrySettings) -> BlobStore:
    if settings.s3_endpoint:
        return S3BlobStore(
            settings.s3_endpoint,
            settings.s3_access_key,
            settings.s3_secret_key,
            settings.s3_bucket,
            secure=settings.s3_secure,
            region=settings.s3_region,
            prefix=settings.s3_prefix,
        )
    return LocalBlobStore(Path(settings.archive_dir or Path(settings.data_dir) / "model_registry"))


class ModelRegistryService(Service[ModelRegistrySettings]):
    name = "model_registry"
    settings_type = ModelRegistrySettings
    description = "Cogment Model Registry: models and their versions, data in a local directory or S3."

    def __init__(
        self,
        settings: ModelRegistrySettings,
        *,
        database: Database | None = None,
        blobs: BlobStore | None = None,
    ) -> None:
        super().__init__(settings, database=database)
        self.feed = ChangeFeed(self.database, CHANGE_CHANNEL)
        self.store = RegistryStore(self.database)
        try:
            self.blobs = blobs or blob_store(settings)
        except BlobStoreError as error:  # keys half given, an endpoint that is not one
            raise StartupError(str(error)) from None
        self.registry = ModelRegistry(
            self.store,
            self.feed,
            self.blobs,
            cache_max_items=settings.cache_max_items,
            chunk_size=settings.sent_version_chunk_size,
            data_cache_bytes=settings.data_cache_bytes,
            dependencies=self.dependencies,
        )
        self.dependencies.add(Dependency("blob store", self.blobs.probe))
        registry = self.registry
        metrics.watch(subscribers=lambda: registry.version_update_streams)
        self.registration = self.directory_registration([directory_pb2.MODEL_REGISTRY_SERVICE])

    async def start(self, runtime: ServiceRuntime) -> None:
        log.info("opening storage", database=self.database.display_url, blobs=self.blobs.description)
        await self.database.migrate()
        await self.feed.start()
        try:
            await self.blobs.start()
        except BlobStoreError as error:  # unreachable, refused credentials: the operator's to fix
            raise StartupError(str(error)) from error
        self.registry.start()

    def add_servicers(self, server: grpc.aio.Server, runtime: ServiceRuntime) -> Sequence[str]:
        return add_servicers(server, self.registry, runtime)

    async def stop(self) -> None:
        await self.registry.stop()
        await self.blobs.close()
        await self.feed.stop()
