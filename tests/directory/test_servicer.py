"""The directory's gRPC layer on its own: what Inquire's replies encode, and what it remembers."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator

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


def test_answers_hold_while_their_stamp_does_and_what_is_remembered_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = servicer.EncodedAnswers()
    answers.put(b"inquiry", "token", 5, [b"reply"], 5)
    assert answers.get(b"inquiry", "token", 5) == [b"reply"]
    assert answers.get(b"inquiry", "token", 6) is None  # something changed since
    assert answers.get(b"inquiry", "other token", 5) is None
    answers.put(b"other", "token", 6, [b"new reply"], 9)  # a newer stamp: the older answers go
    assert answers.get(b"inquiry", "token", 5) is None
    assert answers.get(b"other", "token", 6) == [b"new reply"]
    answers.put(b"late", "token", 5, [b"late reply"], 10)  # found before the change: dropped
    assert answers.get(b"late", "token", 5) is None and answers.get(b"late", "token", 6) is None
    overhead = servicer.ANSWER_OVERHEAD_BYTES + servicer.REPLY_OVERHEAD_BYTES
    assert answers._bytes == len(b"other") + len("token") + 9 + overhead
    assert answers.accepts(b"x" * 4000, "t" * 96)
    assert not answers.accepts(b"x" * 4000, "t" * 97)  # over REMEMBERED_REQUEST_BYTES
    monkeypatch.setattr(servicer, "ANSWERS_REMEMBERED", 3)
    for index in range(10):
        answers.put(b"%d" % index, "", 6, [b"r"], 1)
        assert len(answers._answers) <= 3
    monkeypatch.setattr(servicer, "ANSWERS_BYTES", 2000)
    for index in range(10):
        answers.put(b"%d" % index, "token", 6, [b"r" * 10], 10)
        assert answers._bytes <= 2000


class _Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class _Directory:
    """Answers every inquiry with `entries`, counting the inquiries it was asked."""

    def __init__(self, entries: list[Entry], stamp: int | None) -> None:
        self.entries = entries
        self.stamp = stamp
        self.inquiries = 0

    def answer_stamp(self) -> int | None:
        return self.stamp

    async def inquire(self, inquiry: object, token: str) -> AsyncIterator[list[Entry]]:
        self.inquiries += 1
        yield self.entries


async def _ports(inquirer: servicer.DirectoryServicer, request: bytes) -> list[int]:
    return [port_of(reply) async for reply in inquirer.Inquire(request, _Context())]


async def test_inquire_remembers_small_answers_while_their_stamp_holds() -> None:
    request = directory_pb2.InquireRequest(service_id=7).SerializeToString()
    directory = _Directory([entry(7, 9000)], stamp=1)
    inquirer = servicer.DirectoryServicer(directory, None)  # type: ignore[arg-type]
    assert await _ports(inquirer, request) == await _ports(inquirer, request) == [9000]
    assert directory.inquiries == 1
    directory.stamp, directory.entries = 2, [entry(7, 9001)]
    assert await _ports(inquirer, request) == [9001]
    assert directory.inquiries == 2
    # Not a function of the index alone (e.g. load balanced): never remembered.
    directory.stamp = None
    await _ports(inquirer, request)
    await _ports(inquirer, request)
    assert directory.inquiries == 4


async def test_inquire_answers_a_wide_answer_whole_without_remembering_it() -> None:
    wide = [entry(service_id, 9000 + service_id) for service_id in range(1, 1000)]
    request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=3)).SerializeToString()
    directory = _Directory(wide, stamp=1)
    inquirer = servicer.DirectoryServicer(directory, None)  # type: ignore[arg-type]
    assert await _ports(inquirer, request) == [9000 + service_id for service_id in range(1, 1000)]
    assert sum(len(servicer.EncodedReplies().of(e)) for e in wide) > servicer.REMEMBERED_ANSWER_BYTES
    assert inquirer.answers._answers == {}
    await _ports(inquirer, request)
    assert directory.inquiries == 2
