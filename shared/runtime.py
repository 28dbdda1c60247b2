"""What every servicer shares: `Version` and `Status` as every Cogment service answers them, and
the load monitor behind `overall_load`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from shared.api import common_pb2
from shared.load import LoadMonitor
from shared.version import COGMENT_API_VERSION, PACKAGE_VERSION

StatusProvider = Callable[[], Awaitable[str]]


class ServiceRuntime:
    """What every servicer shares: versions, statuses and the load monitor."""

    def __init__(self, service: str, load: LoadMonitor) -> None:
        self.load = load
        self._versions = [
            ("cogment-api", COGMENT_API_VERSION),
            ("grpc", grpc.__version__),
            ("cogment-aux", PACKAGE_VERSION),
            (f"cogment-aux-{service}", PACKAGE_VERSION),
        ]
        self._statuses: dict[str, StatusProvider] = {}
        self.add_status("overall_load", self._overall_load)

    async def _overall_load(self) -> str:
        return str(self.load.overall_load)

    def add_status(self, name: str, provider: StatusProvider) -> None:
        self._statuses[name] = provider

    def version_info(self) -> common_pb2.VersionInfo:
        return common_pb2.VersionInfo(
            versions=[common_pb2.VersionInfo.Version(name=name, version=v) for name, v in self._versions]
        )

    async def status_reply(self, names: Iterable[str]) -> common_pb2.StatusReply:
        """Names are read in order, unknown ones ignored; `*` adds every status and ends the scan."""
        wanted: list[str] = []
        for name in names:
            if name == "*":
                wanted.extend(self._statuses)
                break
            if name in self._statuses:
                wanted.append(name)
        reply = common_pb2.StatusReply()
        for name in dict.fromkeys(wanted):
            reply.statuses[name] = await self._statuses[name]()
        return reply


class VersionStatusMixin:
    """`Version` and `Status`, which every Cogment service answers the same way."""

    runtime: ServiceRuntime

    async def Version(self, request: common_pb2.VersionRequest, context: Any) -> common_pb2.VersionInfo:
        return self.runtime.version_info()

    async def Status(self, request: common_pb2.StatusRequest, context: Any) -> common_pb2.StatusReply:
        return await self.runtime.status_reply(request.names)
