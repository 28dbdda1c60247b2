"""What the live replay buffer's tests share: where a datastore is, what a directory lists, and a
buffer the rate limiter holds back once nobody samples it."""

from __future__ import annotations

import asyncio

from services.datastore.client.replay_buffer import ReplayBuffer
from shared.api import directory_pb2
from tests.helpers.running import RunningDatastore, RunningDirectory


def endpoint(d: RunningDatastore) -> str:
    return f"grpc://127.0.0.1:{d.service.port}"


async def directory_entries(directory: RunningDirectory) -> list[directory_pb2.FullServiceData]:
    """The datastores `directory` lists."""
    inquiry = directory_pb2.InquireRequest(
        details=directory_pb2.ServiceDetails(type=directory_pb2.DATASTORE_SERVICE)
    )
    return [reply.data async for reply in directory.stub.Inquire(inquiry)]


async def held_buffer(d: RunningDatastore) -> ReplayBuffer:
    """A buffer fed by `d` whose ratio (one sample per insert, give or take one) holds its feed
    back after a few inserts, unless it is sampled."""
    return await asyncio.to_thread(
        ReplayBuffer.from_datastore, endpoint(d), capacity=1000, samples_per_insert=1.0, error_buffer=1.0
    )
