"""The directory's gRPC layer on its own: what Inquire's replies encode, and what it remembers."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from services.directory import servicer
from services.directory.model import GRPC, Endpoint, Entry
from shared.api import directory_pb2


def entry(service_id: int, port: int, value: str = "x") -> Entry:
    return Entry(
        service_id, Endpoint(GRPC, "127.0.0.1", port), 3, {"a": value}, permanent=False, registered_at=1
    )


def port_of(encoded: bytes) -> int:
    return directory_pb2.InquireReply.FromString(encoded).data.endpoint.port


def test_a_reply_is_encoded_once_per_record_of_an_entry() -> None:
    replies = servicer.EncodedReplies()
    first = entry(7, 9000)
    encoded = replies.of(first)
    assert directory_pb2.InquireReply.FromString(encoded).data == servicer.full_service_data(first)
    assert replies.of(first) is encoded  # the same record: the same bytes, not encoded again
    # The entry changed (the index holds a new record): its new endpoint is answered.
    moved = dataclasses.replace(first, endpoint=Endpoint(GRPC, "127.0.0.1", 9001))
    assert port_of(replies.of(moved)) == 9001
    assert replies._bytes == len(replies.of(moved))


def test_what_is_remembered_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicer, "REPLIES_REMEMBERED", 3)
    replies = servicer.EncodedReplies()
    kept = [entry(service_id, 9000) for service_id in range(10)]
    for record in kept:
        replies.of(record)
    assert len(replies._replies) <= 3
    # A large reply is answered, not remembered; the bytes remembered stay within their bound.
    large = entry(20, 9000, "v" * 5000)
    assert len(replies.of(large)) > servicer.REMEMBERED_REPLY_BYTES and 20 not in replies._replies
    monkeypatch.setattr(servicer, "REPLIES_BYTES", 200)
    for record in kept:
        replies.of(record)
        assert replies._bytes <= 200
    # A record the index dropped is not kept alive by its remembered reply.
    dropped = entry(30, 9000)
    replies.of(dropped)
    del dropped
    gc.collect()
    assert replies._replies[30][0]() is None
