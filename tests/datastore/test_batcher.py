"""Group commit of ingested samples (`SampleBatcher`) on a real database: batches bounded in size,
each stream's samples in order and counted as committed, the close marker written once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest

from services.datastore.batcher import SampleBatcher
from services.datastore.ingestion_buffer import IDLE_READ_S, READ_COPIES, IngestionBuffer
from services.datastore.metrics import DATALOG_API
from services.datastore.model import NO_STATE
from services.datastore.store import DatastoreStore, SampleAppend
from shared.api import common_pb2
from shared.db import Database
from shared.validation import MAX_RECEIVE_MESSAGE_BYTES


class RecordingStore(DatastoreStore):
    """The real store, remembering the size of every batch it was given."""

    batches: list[list[SampleAppend]]

    async def append(self, appends: list[SampleAppend], *, retry: bool = False) -> list[int | None]:  # type: ignore[override]
        self.batches.append(list(appends))
        return await super().append(appends, retry=retry)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[RecordingStore]:
    database = Database(database_url)
    await database.migrate()
    store = RecordingStore(database)
    store.batches = []
    yield store
    await database.close()


async def _settled(buffer: IngestionBuffer) -> None:
    while buffer.failure is None and (buffer.committed < buffer.submitted or buffer.has_work()):
        await buffer.progressed.wait()
        buffer.progressed.clear()


async def test_batches_are_bounded_and_streams_keep_their_order(store: RecordingStore) -> None:
    seqs = [await store.upsert_trial(f"t{index}", "u", b"", {}, 0) for index in range(3)]
    batcher = SampleBatcher(store, max_samples=50)
    batcher.start()
    buffers = [batcher.open(seq, DATALOG_API) for seq in seqs]
    for number in range(120):
        for buffer in buffers:
            buffer.add(f"{buffer.trial_seq}:{number}".encode(), common_pb2.RUNNING)
    buffers[1].add(b"end", common_pb2.ENDED)
    for buffer in buffers:
        buffer.close()
    await asyncio.wait_for(asyncio.gather(*(_settled(buffer) for buffer in buffers)), 30)
    await batcher.stop()

    assert all(sum(len(a.samples) for a in batch) <= 50 for batch in store.batches)
    assert [buffer.committed for buffer in buffers] == [120, 121, 120]
    assert all(buffer.closed for buffer in buffers)
    # One close marker per stream, after its last sample.
    closes = [a.trial_seq for batch in store.batches for a in batch if a.close]
    assert sorted(closes) == sorted(seqs)
    for buffer in buffers:
        stored = await store.read_samples(buffer.trial_seq, 0, 1000)
        expected = [f"{buffer.trial_seq}:{n}".encode() for n in range(120)]
        assert stored == expected + ([b"end"] if buffer is buffers[1] else [])
    progress = [await store.progress(seq) for seq in seqs]
    assert [(p.samples_count, p.ended, p.closed) for p in progress if p] == [
        (120, False, True),
        (121, True, True),
        (120, False, True),
    ]


async def test_a_deleted_trial_fails_its_stream_only(store: RecordingStore) -> None:
    kept, deleted = [await store.upsert_trial(name, "u", b"", {}, 0) for name in ["kept", "deleted"]]
    batcher = SampleBatcher(store)
    batcher.start()
    await store.delete_trials(["deleted"])
    buffers = [batcher.open(kept, DATALOG_API), batcher.open(deleted, DATALOG_API)]
    for buffer in buffers:
        buffer.add(b"x", NO_STATE)
    await asyncio.wait_for(asyncio.gather(*(_settled(buffer) for buffer in buffers)), 30)
    await batcher.stop()
    assert buffers[0].committed == 1 and buffers[0].failure is None
    assert buffers[1].committed == 0 and buffers[1].failure is not None


async def test_bytes_in_flight_are_bounded_per_stream_and_per_process(store: RecordingStore) -> None:
    seqs = [await store.upsert_trial(name, "u", b"", {}, 0) for name in ["a", "b", "gone"]]
    batcher = SampleBatcher(store, max_stream_bytes=100, max_in_flight_bytes=250)
    first, second, doomed = (batcher.open(seq, DATALOG_API) for seq in seqs)
    first.add(b"x" * 99, NO_STATE)
    assert batcher.has_room(first)
    first.add(b"x", NO_STATE)  # its own bound reached: only this stream waits
    assert not batcher.has_room(first) and batcher.has_room(second)
    second.add(b"y" * 30, NO_STATE)
    doomed.add(b"z" * 20, NO_STATE)
    # A read acquires three times the largest sample its stream sent: 150 + 90 bytes.
    second_read = await second.acquire_read()
    assert batcher.in_flight_bytes == 240
    doomed_read = asyncio.create_task(doomed.acquire_read())  # 60 more: it waits its turn
    await asyncio.sleep(0.01)
    assert not doomed_read.done()
    second_read.release()
    doomed_room = await asyncio.wait_for(doomed_read, 1)
    assert batcher.in_flight_bytes == 210

    await store.delete_trials(["gone"])
    batcher.start()
    await asyncio.wait_for(asyncio.gather(*(_settled(b) for b in (first, second, doomed))), 30)
    await batcher.stop()
    # A failed stream's samples (its trial was deleted) no longer count either: only the read.
    assert doomed.failure is not None
    assert (first.in_flight_bytes, second.in_flight_bytes, doomed.in_flight_bytes) == (0, 0, 0)
    assert batcher.in_flight_bytes == 60
    doomed_room.release()
    assert batcher.in_flight_bytes == 0
    assert all(batcher.has_room(buffer) for buffer in (first, second))


async def test_a_new_stream_expects_what_new_streams_sent_lately(store: RecordingStore) -> None:
    seqs = [await store.upsert_trial(name, "u", b"", {}, 0) for name in ["a", "b", "c"]]
    batcher = SampleBatcher(store, max_in_flight_bytes=10 * 2**20)
    first, second, third = (batcher.open(seq, DATALOG_API) for seq in seqs)
    # Before any sample, a stream's first read expects the largest message gRPC accepts: it
    # waits for room, and is admitted alone since nothing else is held.
    room = await asyncio.wait_for(first.acquire_read(), 1)
    assert room.size == READ_COPIES * MAX_RECEIVE_MESSAGE_BYTES
    first.add(b"x" * 1000, NO_STATE)
    room.release()
    second_room = await second.acquire_read()
    assert second_room.size == READ_COPIES * 1000
    second_room.release()
    # A stream expects what it sent itself, once it sent something.
    third.add(b"x" * 10, NO_STATE)
    third_room = await third.acquire_read()
    assert third_room.size == READ_COPIES * 10
    third_room.release()


async def test_an_idle_read_keeps_little_room(store: RecordingStore) -> None:
    seq = await store.upsert_trial("a", "u", b"", {}, 0)
    batcher = SampleBatcher(store, max_in_flight_bytes=64 * 2**20)
    buffer = batcher.open(seq, DATALOG_API)
    buffer.add(b"x" * (8 * 2**20), NO_STATE)
    room = await buffer.acquire_read()
    assert batcher.in_flight_bytes == 32 * 2**20
    await asyncio.sleep(IDLE_READ_S + 0.2)  # its client sends nothing: others need not wait for it
    assert batcher.in_flight_bytes == 8 * 2**20
    room.release()
    assert batcher.in_flight_bytes == 8 * 2**20


async def test_one_batch_may_hold_a_trial_twice(store: RecordingStore) -> None:
    """Two streams of one trial (two AddSample calls, a datalog retried while its old stream's
    close is queued) put it twice in a batch: both appends stored, numbered one after the other,
    an append of a deleted trial and a close-only append beside them."""
    twice, other, gone = [
        await store.upsert_trial(name, "u", b"", {}, 0) for name in ["twice", "other", "gone"]
    ]
    await store.delete_trials(["gone"])
    firsts = await store.append(
        [
            SampleAppend(twice, 1, 0, [b"a0", b"a1"], last_state=None, ended=False, close=False),
            SampleAppend(other, 3, 0, [b"o0"], last_state=common_pb2.RUNNING, ended=False, close=False),
            SampleAppend(gone, 4, 0, [b"g0"], last_state=None, ended=False, close=False),
            SampleAppend(twice, 2, 0, [b"b0"], last_state=common_pb2.ENDED, ended=True, close=False),
        ]
    )
    assert firsts == [0, 0, None, 2]
    assert await store.read_samples(twice, 0, 10) == [b"a0", b"a1", b"b0"]
    assert await store.read_samples(other, 0, 10) == [b"o0"]
    # Each trial once, with a close-only append: the one-statement path on PostgreSQL.
    firsts = await store.append(
        [
            SampleAppend(other, 3, 1, [], last_state=None, ended=False, close=True),
            SampleAppend(twice, 2, 1, [b"c0", b"c1"], last_state=None, ended=False, close=True),
            SampleAppend(gone, 4, 1, [b"g1"], last_state=None, ended=False, close=True),
        ]
    )
    assert firsts == [1, 3, None]
    assert await store.read_samples(twice, 0, 10) == [b"a0", b"a1", b"b0", b"c0", b"c1"]
    progress = {seq: await store.progress(seq) for seq in (twice, other, gone)}
    assert progress[gone] is None
    assert [(p.samples_count, p.ended, p.closed) for p in (progress[twice], progress[other]) if p] == [
        (5, True, True),
        (1, False, True),
    ]


async def test_a_retried_append_stores_only_what_an_earlier_attempt_did_not(store: RecordingStore) -> None:
    """An append retried after an attempt whose outcome is unknown: what that attempt stored
    (recorded per stream, whichever way it was written) is not stored again."""
    seq, other = [await store.upsert_trial(name, "u", b"", {}, 0) for name in ["t", "other"]]
    # Each trial once: on PostgreSQL, the one-statement path records the positions.
    first_attempt = [SampleAppend(seq, 7, 0, [b"s0", b"s1"]), SampleAppend(other, 8, 0, [b"o0"])]
    assert await store.append(first_attempt) == [0, 0]
    # Its answer was lost: tried again, nothing is stored twice, and the trial's flags still apply.
    retried = [SampleAppend(seq, 7, 0, [b"s0", b"s1"], ended=True), SampleAppend(other, 8, 0, [b"o0"])]
    assert await store.append(retried, retry=True) == [2, 1]
    # Another stream of the same trial, and this stream's next samples after a partial overlap.
    assert await store.append(
        [SampleAppend(seq, 9, 0, [b"x0"]), SampleAppend(seq, 7, 1, [b"s1", b"s2"])], retry=True
    ) == [2, 3]
    assert await store.read_samples(seq, 0, 10) == [b"s0", b"s1", b"x0", b"s2"]
    assert await store.read_samples(other, 0, 10) == [b"o0"]
    progress = await store.progress(seq)
    assert progress is not None and (progress.samples_count, progress.ended) == (4, True)
    # A first attempt is not checked against what is recorded (nothing can be there).
    assert await store.append([SampleAppend(other, 8, 1, [b"o1"])]) == [1]
    assert await store.read_samples(other, 0, 10) == [b"o0", b"o1"]


def _lose_answers(database: Database, patch: pytest.MonkeyPatch, times: int) -> list[int]:
    """The next `times` sample writes commit, but their answers are lost (the connection broke
    once the database had committed); returns the count of answers lost so far."""
    lost: list[int] = []
    dialect = database.dialect

    def losing(write: Callable[..., asyncio.Future[Any]]) -> Callable[..., asyncio.Future[Any]]:
        def lose(*args: Any) -> asyncio.Future[Any]:
            committed = write(*args)
            if len(lost) >= times:
                return committed
            lost.append(1)
            answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

            def swallow(done: asyncio.Future[Any]) -> None:
                assert done.exception() is None  # it committed
                answer.set_exception(psycopg.OperationalError("server closed the connection unexpectedly"))

            committed.add_done_callback(swallow)
            return answer

        return lose

    patch.setattr(dialect, "on_cursor", losing(dialect.on_cursor))
    patch.setattr(dialect, "statement", losing(dialect.statement))
    return lost


async def test_samples_whose_commit_answer_was_lost_are_stored_once(store: RecordingStore) -> None:
    """The batcher rides a lost answer out like an outage and tries again; the retry finds the
    samples stored and stores each once, in order."""
    seqs = [await store.upsert_trial(f"t{index}", "u", b"", {}, 0) for index in range(3)]
    batcher = SampleBatcher(store, max_samples=40)
    with pytest.MonkeyPatch.context() as patch:
        lost = _lose_answers(store.db, patch, times=3)
        batcher.start()
        buffers = [batcher.open(seq, DATALOG_API) for seq in seqs]
        for number in range(50):
            for buffer in buffers:
                buffer.add(f"{buffer.trial_seq}:{number}".encode(), common_pb2.RUNNING)
        for buffer in buffers:
            buffer.close()
        await asyncio.wait_for(asyncio.gather(*(_settled(buffer) for buffer in buffers)), 30)
    await batcher.stop()
    assert len(lost) == 3
    assert [buffer.failure for buffer in buffers] == [None, None, None]
    for buffer in buffers:
        assert await store.read_samples(buffer.trial_seq, 0, 1000) == [
            f"{buffer.trial_seq}:{number}".encode() for number in range(50)
        ]


async def _committed(buffer: IngestionBuffer, count: int) -> None:
    while buffer.failure is None and buffer.committed < count:
        await buffer.progressed.wait()
        buffer.progressed.clear()


async def test_a_steady_flow_shares_transactions_a_sample_after_a_quiet_spell_does_not_wait(
    store: RecordingStore,
) -> None:
    """At most one transaction starts per interval: samples of two streams arriving a moment
    apart share one, where each would otherwise have had its own."""
    quiet, first, second = [await store.upsert_trial(name, "u", b"", {}, 0) for name in "qfs"]
    batcher = SampleBatcher(store, interval_s=0.5)
    batcher.start()
    buffers = [batcher.open(seq, DATALOG_API) for seq in (quiet, first, second)]
    buffers[0].add(b"q", NO_STATE)
    await asyncio.wait_for(_committed(buffers[0], 1), 30)  # nothing written lately: at once
    buffers[1].add(b"f", NO_STATE)
    await asyncio.sleep(0.05)  # long enough for the writer to start a transaction of its own
    buffers[2].add(b"s", NO_STATE)
    await asyncio.wait_for(asyncio.gather(_committed(buffers[1], 1), _committed(buffers[2], 1)), 30)
    await batcher.stop()
    assert [[append.trial_seq for append in batch] for batch in store.batches] == [[quiet], [first, second]]


async def test_a_full_batch_and_a_stop_do_not_wait_for_the_interval(store: RecordingStore) -> None:
    seqs = [await store.upsert_trial(name, "u", b"", {}, 0) for name in "abcd"]
    batcher = SampleBatcher(store, max_samples=2, max_bytes=100, interval_s=3600.0)
    batcher.start()
    first, large, two, last = (batcher.open(seq, DATALOG_API) for seq in seqs)
    first.add(b"a", NO_STATE)
    await asyncio.wait_for(_committed(first, 1), 30)
    large.add(b"x" * 100, NO_STATE)  # a batch full by bytes: written within the hour
    await asyncio.wait_for(_committed(large, 1), 30)
    two.add(b"b0", NO_STATE)
    two.add(b"b1", NO_STATE)  # full by samples
    await asyncio.wait_for(_committed(two, 2), 30)
    last.add(b"c", NO_STATE)
    await batcher.stop()  # what was received is written
    assert (first.committed, large.committed, two.committed, last.committed) == (1, 1, 2, 1)
