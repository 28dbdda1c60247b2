"""The Model Registry's vocabulary, shared by its gRPC layer, core and store."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """A model: its id and the user data it was created or last updated with."""

    model_id: str
    user_data: dict[str, str]


@dataclass(frozen=True)
class VersionInfo:
    """An immutable version of a model, as clients see it (`data_hash`: base64 SHA-256)."""

    model_id: str
    version_number: int
    creation_timestamp: int
    archived: bool
    data_hash: str
    data_size: int
    user_data: dict[str, str]


@dataclass(frozen=True)
class VersionRecord:
    """A version and where its data lives in the blob store."""

    info: VersionInfo
    blob_key: str


@dataclass(frozen=True)
class VersionHeader:
    """What a CreateVersion header asks for."""

    model_id: str
    archived: bool
    data_size: int
    data_hash: str
    user_data: dict[str, str]
    creation_timestamp: int
