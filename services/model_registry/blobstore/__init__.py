"""Where model version data lives: a blob store, either a local directory (`local`: the embedded
default, under the data directory) or a bucket on any S3-compatible server (`s3`, through the
`minio` client). `memory` holds blobs in memory only, for tests. `base` is the contract they keep
and the machinery they share.
"""

from __future__ import annotations

from services.model_registry.blobstore.base import (
    BlobNotFound,
    BlobStore,
    BlobStoreError,
    BlobStoreUnavailable,
    BlobUpload,
    DigestMismatch,
    InvalidBlobKey,
    validate_key,
)
from services.model_registry.blobstore.local import LocalBlobStore
from services.model_registry.blobstore.memory import MemoryBlobStore
from services.model_registry.blobstore.s3 import DEFAULT_PART_SIZE, MIN_PART_SIZE, S3BlobStore

__all__ = [
    "DEFAULT_PART_SIZE",
    "MIN_PART_SIZE",
    "BlobNotFound",
    "BlobStore",
    "BlobStoreError",
    "BlobStoreUnavailable",
    "BlobUpload",
    "DigestMismatch",
    "InvalidBlobKey",
    "LocalBlobStore",
    "MemoryBlobStore",
    "S3BlobStore",
    "validate_key",
]
