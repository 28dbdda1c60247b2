"""The directory's gRPC layer on its own: what Inquire's replies encode."""

from __future__ import annotations

import dataclasses

import pytest

from services.directory import servicer
from services.directory.model import GRPC, Endpoint, Entry
from shared.api import directory_pb2


def entry(service_id: int, port: int) -> Entry:
    return Entry(
        service_id, Endpoint(GRPC, "127.0.0.1", port), 3, {"a": "x"}, permanent=False, registered_at=1
    )


def test_a_reply_is_encoded_once_per_version_of_an_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    replies = servicer.EncodedReplies()
    first = entry(7, 9000)
    encoded = replies.of(first)
    assert directory_pb2.InquireReply.FromString(encoded).data == servicer.full_service_data(first)
    assert replies.of(first) is encoded  # the same entry: the same bytes, not encoded again
    # The entry changed (the index holds a new record): its new endpoint is answered.
    moved = dataclasses.replace(first, endpoint=Endpoint(GRPC, "127.0.0.1", 9001))
    assert directory_pb2.InquireReply.FromString(replies.of(moved)).data.endpoint.port == 9001
    # Bounded: past the limit, every remembered reply is forgotten.
    monkeypatch.setattr(servicer, "REPLIES_REMEMBERED", 3)
    for service_id in range(1, 4):
        replies.of(entry(service_id, 9000))
    assert directory_pb2.InquireReply.FromString(replies.of(moved)).data.endpoint.port == 9001
    assert len(replies._replies) <= 3
