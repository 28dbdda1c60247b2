"""The Model Registry's gRPC layer: validates requests and translates them for the core (errors
become statuses in the shared call observer, see shared/errors.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.model_registry import metrics
from services.model_registry.core import MAX_POSITION, ModelRegistry, refusal_reason
from services.model_registry.model import ModelInfo, VersionHeader, VersionInfo
from shared.api import model_registry_pb2
from shared.errors import InvalidArgument, NotFound
from shared.handlers import add_servicer, field_one_frame, pre_encoded
from shared.runtime import ServiceRuntime, VersionStatusMixin
from shared.validation import (
    MAX_USER_DATA_BYTES,
    checked_id,
    checked_list,
    checked_size,
    checked_text,
    parse_handle,
    text_bytes,
)

# Timestamps are stored as signed 64-bit integers (nanoseconds: until the year 2262).
MAX_TIMESTAMP = 2**63 - 1


def version_info_message(info: VersionInfo) -> model_registry_pb2.ModelVersionInfo:
    return model_registry_pb2.ModelVersionInfo(
        model_id=info.model_id,
        version_number=info.version_number,
        creation_timestamp=info.creation_timestamp,
        archived=info.archived,
        data_hash=info.data_hash,
        data_size=info.data_size,
        user_data=info.user_data,
    )


def model_info_message(model: ModelInfo) -> model_registry_pb2.ModelInfo:
    return model_registry_pb2.ModelInfo(model_id=model.model_id, user_data=model.user_data)


def data_chunk_frame(chunk: bytes | memoryview) -> bytes:
    """`RetrieveVersionDataReplyChunk(data_chunk=chunk)` encoded (see `field_one_frame`)."""
    return field_one_frame(chunk) if chunk else b""  # proto3 leaves out an empty field


def add_servicers(server: grpc.aio.Server, registry: ModelRegistry, runtime: ServiceRuntime) -> list[str]:
    """Serve the model registry's gRPC service on `server`; its full name."""
    registry_sp = model_registry_pb2.DESCRIPTOR.services_by_name["ModelRegistrySP"]
    servicer = ModelRegistryServicer(registry, runtime)
    return [add_servicer(server, registry_sp, servicer, {"RetrieveVersionData": pre_encoded})]


def _model_id(model_id: str) -> str:
    return checked_id(model_id, "model id")


def _user_data(user_data: Any) -> dict[str, str]:
    data = dict(user_data)
    checked_size(text_bytes(data), "user data bytes", MAX_USER_DATA_BYTES, "MAX_USER_DATA_BYTES")
    for name, value in data.items():
        checked_text(name, "user data")
        checked_text(value, "user data")
    return data


async def _bodies(
    requests: AsyncIterator[model_registry_pb2.CreateVersionRequestChunk],
) -> AsyncIterator[bytes]:
    async for request in requests:
        if request.WhichOneof("msg") != "body":
            raise InvalidArgument("subsequent request chunk do not include a Body")
        yield request.body.data_chunk


class ModelRegistryServicer(VersionStatusMixin):
    """Every ModelRegistrySP method (registered from the service descriptor by
    `add_servicers`, so that RetrieveVersionData can yield encoded frames)."""

    def __init__(self, registry: ModelRegistry, runtime: ServiceRuntime) -> None:
        self.registry = registry
        self.runtime = runtime

    async def CreateOrUpdateModel(
        self, request: model_registry_pb2.CreateOrUpdateModelRequest, context: Any
    ) -> model_registry_pb2.CreateOrUpdateModelReply:
        if not request.HasField("model_info"):
            raise InvalidArgument("missing model_info")
        info = request.model_info
        await self.registry.create_or_update_model(_model_id(info.model_id), _user_data(info.user_data))
        return model_registry_pb2.CreateOrUpdateModelReply()

    async def DeleteModel(
        self, request: model_registry_pb2.DeleteModelRequest, context: Any
    ) -> model_registry_pb2.DeleteModelReply:
        await self.registry.delete_model(_model_id(request.model_id))
        return model_registry_pb2.DeleteModelReply()

    async def RetrieveModels(
        self, request: model_registry_pb2.RetrieveModelsRequest, context: Any
    ) -> model_registry_pb2.RetrieveModelsReply:
        checked_list(request.model_ids, "model_ids")
        offset = parse_handle(request.model_handle, "model_handle", MAX_POSITION)
        models, end = await self.registry.retrieve_models(
            list(request.model_ids),
            request.models_count,
            offset,
            lambda model: model_info_message(model).ByteSize(),
        )
        return model_registry_pb2.RetrieveModelsReply(
            model_infos=[model_info_message(model) for model in models], next_model_handle=str(end)
        )

    async def CreateVersion(
        self, request_iterator: AsyncIterator[model_registry_pb2.CreateVersionRequestChunk], context: Any
    ) -> model_registry_pb2.CreateVersionReply:
        try:
            return await self._create_version(request_iterator)
        except Exception as error:
            reason = refusal_reason(error)
            if reason is not None:
                metrics.refused_uploads_total.inc(reason)
            raise

    async def _create_version(
        self, request_iterator: AsyncIterator[model_registry_pb2.CreateVersionRequestChunk]
    ) -> model_registry_pb2.CreateVersionReply:
        first = await anext(request_iterator, None)
        if first is None:
            raise InvalidArgument("empty request")
        if first.WhichOneof("msg") != "header":
            raise InvalidArgument("first request chunk does not include a Header")
        if not first.header.HasField("version_info"):
            raise InvalidArgument("the Header has no version_info")
        info = first.header.version_info
        if info.creation_timestamp > MAX_TIMESTAMP:
            raise InvalidArgument(
                f"creation_timestamp {info.creation_timestamp} is out of range (ns since 1970)"
            )
        header = VersionHeader(
            model_id=_model_id(info.model_id),
            archived=info.archived,
            data_size=info.data_size,
            data_hash=info.data_hash,
            user_data=_user_data(info.user_data),
            creation_timestamp=info.creation_timestamp,
        )
        created = await self.registry.create_version(header, _bodies(request_iterator))
        return model_registry_pb2.CreateVersionReply(version_info=version_info_message(created))

    async def RetrieveVersionInfos(
        self, request: model_registry_pb2.RetrieveVersionInfosRequest, context: Any
    ) -> model_registry_pb2.RetrieveVersionInfosReply:
        checked_list(request.version_numbers, "version_numbers")
        model_id = _model_id(request.model_id)
        start = parse_handle(request.version_handle, "version_handle", MAX_POSITION)
        infos, end = await self.registry.retrieve_version_infos(
            model_id,
            list(request.version_numbers),
            request.versions_count,
            start,
            lambda info: version_info_message(info).ByteSize(),
        )
        return model_registry_pb2.RetrieveVersionInfosReply(
            version_infos=[version_info_message(info) for info in infos], next_version_handle=str(end)
        )

    async def RetrieveVersionData(
        self, request: model_registry_pb2.RetrieveVersionDataRequest, context: Any
    ) -> AsyncIterator[bytes]:
        """Yields encoded RetrieveVersionDataReplyChunk messages (see `data_chunk_frame`)."""
        record = await self.registry.resolve(_model_id(request.model_id), request.version_number)
        async for chunk in self.registry.version_data(record):
            yield data_chunk_frame(chunk)

    async def VersionUpdate(
        self, request: model_registry_pb2.VersionUpdateRequest, context: Any
    ) -> AsyncIterator[model_registry_pb2.VersionUpdateReply]:
        try:
            updates = self.registry.version_updates(_model_id(request.model_id))
            async for info in updates:
                yield model_registry_pb2.VersionUpdateReply(version_info=version_info_message(info))
        except NotFound as error:
            # An unknown model is INVALID_ARGUMENT here, as the SDK expects
            # (docs/compatibility.md#model-registry).
            raise InvalidArgument(str(error)) from error
