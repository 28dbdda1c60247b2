"""The models' pages: the models the registry holds, a model's versions newest first, and one
version's information (its bytes are streamed by the transport)."""

from __future__ import annotations

import datetime

from services.console.errors import NotFound
from services.console.model import VersionRow
from services.console.sources import Sources, Unavailable
from services.model_registry.client.api import hash_hex
from shared.api import model_registry_pb2


class ModelPages:
    """The rules of the models' pages, over the registry's client."""

    sources: Sources

    async def models(self) -> list[model_registry_pb2.ModelInfo]:
        models: list[model_registry_pb2.ModelInfo] = await self.sources.registry(
            lambda client: client.list_models(),
        )
        return models

    async def versions(self, model_id: str) -> list[VersionRow]:
        if not await self.sources.registry(lambda c: c.model_exists(model_id)):
            raise NotFound(f"no model [{model_id}]")
        infos = await self.sources.registry(lambda c: c.list_versions(model_id))
        return [version_row(info) for info in reversed(infos)]

    async def version(self, model_id: str, number: int) -> model_registry_pb2.ModelVersionInfo:
        try:
            info: model_registry_pb2.ModelVersionInfo = await self.sources.registry(
                lambda c: c.version_info(model_id, number),
            )
        except Unavailable as error:
            if "not found" in str(error):
                raise NotFound(f"no version [{number}] of model [{model_id}]") from None
            raise
        return info


def version_row(info: model_registry_pb2.ModelVersionInfo) -> VersionRow:
    return VersionRow(
        info.version_number,
        utc_time(info.creation_timestamp),
        info.data_size,
        hash_hex(info.data_hash),
        info.archived,
        dict(info.user_data),
    )


def utc_time(nanoseconds: int) -> str:
    moment = datetime.datetime.fromtimestamp(nanoseconds / 1e9, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
