"""A replay buffer fed by datastores: trials followed as they are created (`RetrieveTrials`,
waiting for the next) on one datastore or every replica a directory lists, each trial read once
by ranges (`RetrieveSampleRange`, the datastore waiting for a running trial's next samples), turned
into the selected actors' steps by `replay_steps`.

Every feed of the process runs on one event loop in a thread of its own, so that the training
loop's `sample()` stays synchronous; a read that fails with its datastore away goes on elsewhere,
and a failure that lasts or cannot pass (a decoder raising) is handed to the buffer, whose next
call raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

import grpc

from services.datastore.client.api import DatastoreClient
from services.datastore.client.replay_steps import ActorSelection, DecodedColumn, Decoder, LiveTrial
from shared.api import trial_datastore_pb2
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError

if TYPE_CHECKING:
    from services.datastore.client.replay_buffer import ReplayBuffer

T = TypeVar("T")
# Samples turned into steps together at most: one `extend` per actor for all of them.
BATCH_SAMPLES = 256
# How long a sample of a busy stream waits for others to be turned into steps with it.
LINGER_S = 0.005
# Samples asked for per RetrieveSampleRange (the datastore answers up to 2 MiB of them), and how
# long it waits for a running trial's next one (it answers as soon as one is stored).
RANGE_SAMPLES = 1000
RANGE_WAIT_MS = 10_000
# How long one RetrieveTrials waits for the next trial (the datastore answers as soon as one comes).
FOLLOW_WAIT_MS = 10_000
# Trials listed per page while looking for where the listing ends (or for backfill).
PAGE_TRIALS = 1000
# What a read is tried again after (on another replica if there is one): the datastore away,
# restarting, or too slow to answer.
RETRIED = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# The first and the longest wait between two attempts of a read (doubled each time).
BACKOFF_S = (0.1, 5.0)
# An attempt that ran this long before it failed had reached its datastore (see `_Retry`).
SETTLED_S = 1.0

log = logging.getLogger(__name__)

_FEEDS_LOOP: asyncio.AbstractEventLoop | None = None
_FEEDS_LOOP_LOCK = threading.Lock()


def _feeds_loop() -> asyncio.AbstractEventLoop:
    """The event loop every feed of the process runs on, in a thread of its own, for the life of
    the process. One loop, never closed: gRPC's asyncio support keeps calling into each loop it
    served, and a loop closed under it prints "Event loop is closed" tracebacks."""
    global _FEEDS_LOOP
    with _FEEDS_LOOP_LOCK:
        if _FEEDS_LOOP is None:
            _FEEDS_LOOP = asyncio.new_event_loop()
            threading.Thread(target=_FEEDS_LOOP.run_forever, name="replay-feeds", daemon=True).start()
        return _FEEDS_LOOP


class _End:
    """What `_batches`' reader leaves last: the replies ended, or failed with `error`."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


async def _batches(replies: AsyncIterable[T], most: int, linger_s: float) -> AsyncIterator[list[T]]:
    """`replies` in lists, so that the consumer's costs per call are shared by many replies: when
    another reply is there as soon as one came (the stream is busy), those that come within
    `linger_s` of the first (`most` at most, and held); a reply that came alone goes alone, at
    once. (A stream's replies come one read at a time: while the consumer works, none come.)"""
    queue: asyncio.Queue[T | _End] = asyncio.Queue(most)

    async def read() -> None:
        try:
            async for reply in replies:
                await queue.put(reply)
        except Exception as error:
            await queue.put(_End(error))
        else:
            await queue.put(_End(None))

    reader = asyncio.create_task(read())
    try:
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(0)  # a reply already received comes in
            if not queue.empty():  # more are coming: wait for them, not when one came alone
                await asyncio.sleep(linger_s)
            while len(batch) < most and not queue.empty() and not isinstance(batch[-1], _End):
                batch.append(queue.get_nowait())
            last = batch[-1]
            end = last if isinstance(last, _End) else None
            if end is not None:
                batch.pop()
            if batch:
                yield cast(list[T], batch)
            if end is not None:
                if end.error is not None:
                    raise end.error
                return
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


class _Retry:
    """Attempts of one read: the backoff between them, and how long they have failed. An attempt
    that ran `SETTLED_S` before it failed had reached its datastore: the next failure starts a
    new count (an idle stream reports no progress of its own)."""

    def __init__(self, what: str, give_up_s: float) -> None:
        self._what = what
        self._give_up_s = give_up_s
        self._failing_since: float | None = None
        self._attempt_started = time.monotonic()
        self._delay_s = BACKOFF_S[0]

    def attempting(self) -> None:
        self._attempt_started = time.monotonic()

    def progressed(self) -> None:
        if self._failing_since is not None:
            log.info("%s: going on", self._what)
        self._failing_since = None
        self._delay_s = BACKOFF_S[0]

    async def failed(self, error: grpc.aio.AioRpcError) -> None:
        """Wait before the next attempt; raise `error` if it cannot pass (not `RETRIED`), or
        has failed for `give_up_s`."""
        if error.code() not in RETRIED:
            raise error
        now = time.monotonic()
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED and now - self._attempt_started >= SETTLED_S:
            self.progressed()  # (an attempt that ran out of time had no answer: no progress)
        if self._failing_since is None:
            self._failing_since = now
            log.warning("%s: %s (%s), trying again", self._what, error.code().name, error.details())
        elif now - self._failing_since > self._give_up_s:
            raise error
        await asyncio.sleep(self._delay_s)
        self._delay_s = min(2 * self._delay_s, BACKOFF_S[1])


@dataclass
class _Listed:
    """A trial the feed knows of: the datastores that listed it, and whether it was read."""

    by: set[str] = field(default_factory=set)
    read: bool = False


class DatastoreFeed:
    """Feeds `buffer` from the datastores `endpoints` lists (one, or every replica a directory
    lists, asked again every `refresh_s`), on the feeds' event loop, until `stop`.

    Each datastore's listing is followed; a trial is read once, from the datastore that listed
    it first (replicas of one database all list it). A read that fails with the datastore away
    goes on where it stopped, from another replica if there is one, with backoff. The buffer
    fails (its next call raises) once every attempt of a read has failed for `timeout_s`, once
    no datastore can be followed for that long, or at once for any other failure. A datastore
    the directory stops listing is followed while it answers; one followed again resumes where
    its listing was."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        endpoints: Callable[[], Awaitable[list[str]]],
        *,
        refresh_s: float | None = None,
        actors: ActorSelection,
        trial_properties: Mapping[str, str] | None = None,
        backfill: bool = False,
        decode_observation: Decoder | None = None,
        decode_action: Decoder | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTls | None = None,
    ) -> None:
        self._buffer = buffer
        self._endpoints = endpoints
        self._refresh_s = refresh_s
        self._actors = actors
        self._properties = dict(trial_properties or {})
        self._backfill = backfill
        self._observations = DecodedColumn(decode_observation)
        self._actions = DecodedColumn(decode_action)
        self._timeout_s = timeout_s
        self._tls = tls
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._main: asyncio.Task[None] | None = None
        self._room: asyncio.Event | None = None  # set by the buffer when samples make room
        self._clients: dict[str, DatastoreClient] = {}
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._handles: dict[str, str] = {}  # where each datastore's listing was followed to
        self._trials: set[asyncio.Task[None]] = set()
        self._reads: dict[str, set[asyncio.Task[None]]] = {}  # attempts reading from each datastore
        # Trials listed, until read and listed by every datastore known (none lists it again).
        self._listed: dict[str, _Listed] = {}
        self._matched = False  # a trial had selected actors
        self.unmatched: str | None = None  # until then, why the last trial had none

    def start(self) -> None:
        """Once the trials to follow are known: every trial created from now on is fed."""
        loop = _feeds_loop()
        loop.call_soon_threadsafe(self._create)
        self._started.wait()

    def stop(self) -> None:
        main = self._main
        if main is not None:
            main.get_loop().call_soon_threadsafe(main.cancel)
            self._stopped.wait()

    def _create(self) -> None:
        loop = asyncio.get_running_loop()
        room = self._room = asyncio.Event()

        def made_room() -> None:
            loop.call_soon_threadsafe(room.set)

        self._buffer.on_change(made_room)
        self._main = loop.create_task(self._feed(), name="replay-feed")
        self._main.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Task[None]) -> None:
        self._started.set()  # (a feed that failed before it started: its failure is the buffer's)
        self._stopped.set()

    async def _feed(self) -> None:
        try:
            await self._start()
            self._started.set()
            while True:  # the followers and readers do the work
                await (asyncio.Event().wait() if self._refresh_s is None else asyncio.sleep(self._refresh_s))
                await self._refresh()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._failed(error)
        finally:
            tasks = [*self._followers.values(), *self._trials]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(client.close() for client in self._clients.values()))

    async def _start(self) -> None:
        """Follow each datastore that answers from where its listing ends now, and read the
        trials to backfill: the latest stored ones whose selected actors' steps fill the
        capacity (read together: when they overshoot it, the oldest steps of each leave first)."""
        endpoints = await self._endpoints()
        if not endpoints:
            raise ClientError("no trial datastore is listed: nothing to follow")
        listed: dict[str, tuple[trial_datastore_pb2.StoredTrialInfo, str]] = {}
        listed_by: dict[str, set[str]] = {}
        for endpoint in endpoints:
            try:
                handle, infos = await self._listing(endpoint)
            except grpc.aio.AioRpcError as error:
                if len(endpoints) == 1:
                    raise
                log.warning("the replay feed cannot follow %s yet: %s", endpoint, error.code().name)
                continue
            self._start_follower(endpoint, handle)
            for info in infos:
                listed.setdefault(info.trial_id, (info, endpoint))
                listed_by.setdefault(info.trial_id, set()).add(endpoint)
        if not self._followers:
            raise ClientError(f"none of the trial datastores listed can be reached: {', '.join(endpoints)}")
        backlog: list[tuple[trial_datastore_pb2.StoredTrialInfo, str]] = []
        steps = 0
        for info, endpoint in reversed(listed.values()):
            if steps >= self._buffer.capacity:
                break
            backlog.append((info, endpoint))
            steps += info.samples_count * len(self._actors.indices(info.params))
        for info, endpoint in reversed(backlog):
            self._read(info, endpoint)
            self._listed[info.trial_id].by |= listed_by[info.trial_id]

    async def _listing(self, endpoint: str) -> tuple[str, list[trial_datastore_pb2.StoredTrialInfo]]:
        """Where `endpoint`'s listing ends, and its trials if backfilling."""
        handle = ""
        listed: list[trial_datastore_pb2.StoredTrialInfo] = []
        while True:
            reply = await self._client(endpoint).list_trials(PAGE_TRIALS, handle, self._properties)
            listed.extend(reply.trial_infos if self._backfill else [])
            handle = reply.next_trial_handle or handle
            if len(reply.trial_infos) < PAGE_TRIALS:
                return handle, listed

    async def _refresh(self) -> None:
        """Follow the datastores listed now that are not followed: from where their listing was
        followed to, or (new ones) from where it ends. Those no longer listed are followed while
        they answer; one whose follower stopped is forgotten."""
        try:
            endpoints = await self._endpoints()
        except ClientError as error:
            log.warning("the replay feed keeps its datastores: %s", error)
            return
        for endpoint in set(self._handles) - set(self._followers) - set(endpoints):
            self._forget_datastore(endpoint)
        for endpoint in endpoints:
            if endpoint in self._followers:
                continue
            handle = self._handles.get(endpoint)
            if handle is None:
                try:
                    handle, _ = await self._listing(endpoint)
                except grpc.aio.AioRpcError as error:
                    log.warning("the replay feed cannot follow %s yet: %s", endpoint, error.code().name)
                    continue
            log.info("the replay feed follows %s", endpoint)
            self._start_follower(endpoint, handle)

    def _client(self, endpoint: str) -> DatastoreClient:
        if endpoint not in self._clients:
            self._clients[endpoint] = DatastoreClient(endpoint, self._timeout_s, self._tls)
        return self._clients[endpoint]

    def _start_follower(self, endpoint: str, handle: str) -> None:
        self._handles[endpoint] = handle
        task = asyncio.create_task(self._follow(endpoint), name=f"replay-follow-{endpoint}")
        self._followers[endpoint] = task
        task.add_done_callback(lambda done: self._follower_done(endpoint, done))

    async def _follow(self, endpoint: str) -> None:
        """Read each trial `endpoint` lists after its handle that no other datastore listed first."""
        retry = _Retry(f"following the trials of {endpoint}", self._timeout_s)
        while True:
            retry.attempting()
            try:
                reply = await self._client(endpoint).stub.RetrieveTrials(
                    trial_datastore_pb2.RetrieveTrialsRequest(
                        trials_count=1,
                        trial_handle=self._handles[endpoint],
                        timeout=FOLLOW_WAIT_MS,
                        properties=self._properties,
                    ),
                    timeout=FOLLOW_WAIT_MS / 1000 + self._timeout_s,
                )
            except grpc.aio.AioRpcError as error:
                await retry.failed(error)
                continue
            retry.progressed()
            self._handles[endpoint] = reply.next_trial_handle or self._handles[endpoint]
            for info in reply.trial_infos:
                self._read(info, endpoint)

    def _follower_done(self, endpoint: str, task: asyncio.Task[None]) -> None:
        if self._followers.get(endpoint) is task:
            del self._followers[endpoint]
        if task.cancelled() or (error := task.exception()) is None:
            return
        if self._followers:  # (listed again later, it is followed again from its handle)
            log.warning("the replay feed stops following %s: %s", endpoint, error)
            # Its reads wait on a datastore gone without closing its connections (a node lost)
            # until their deadlines, or for ever (a stream from a datastore without waiting
            # ranges has none, as a trial may be idle): they go on elsewhere now.
            for attempt in self._reads.get(endpoint, ()):
                attempt.cancel()
        else:
            self._fail(error)

    def _read(self, info: trial_datastore_pb2.StoredTrialInfo, endpoint: str) -> None:
        """Read a trial `endpoint` listed, unless another datastore listed it first."""
        listed = self._listed.get(info.trial_id)
        if listed is None:
            self._listed[info.trial_id] = _Listed({endpoint})
            task = asyncio.create_task(self._trial(info, endpoint), name=f"replay-{info.trial_id}")
            self._trials.add(task)
            task.add_done_callback(self._trials.discard)
            task.add_done_callback(lambda done: self._trial_done(info.trial_id, done))
        else:
            listed.by.add(endpoint)
            self._forget_if_over(info.trial_id)

    def _trial_done(self, trial_id: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            self._fail(error)
            return
        if trial_id in self._listed:
            self._listed[trial_id].read = True
            self._forget_if_over(trial_id)

    def _forget_if_over(self, trial_id: str) -> None:
        """Forget a trial once it was read and every datastore known listed it."""
        listed = self._listed[trial_id]
        if listed.read and listed.by >= set(self._handles):
            del self._listed[trial_id]

    def _forget_datastore(self, endpoint: str) -> None:
        """A datastore neither listed nor followed: it starts again from its listing's end if it
        comes back, and its trials are not waited for."""
        log.info("the replay feed forgets %s: no longer listed", endpoint)
        del self._handles[endpoint]
        for trial_id in list(self._listed):
            self._forget_if_over(trial_id)

    def _fail(self, error: BaseException) -> None:
        self._failed(error)
        if self._main is not None:
            self._main.cancel()  # the buffer has failed: nothing more is fed

    def _failed(self, error: BaseException) -> None:
        """The training loop hears of it at its next call: the datastore away, a decoder raising."""
        if isinstance(error, grpc.aio.AioRpcError):
            error = ClientError(f"the replay feed stopped: {error.code().name}: {error.details()}")
        self._buffer.fail(error)

    async def _trial(self, info: trial_datastore_pb2.StoredTrialInfo, endpoint: str) -> None:
        actors = self._actors.indices(info.params)
        if not actors:
            if not self._matched:  # a mistake in the selection, or a trial of another kind
                self.unmatched = self._actors.selects_none_of(info.trial_id, info.params)
                log.warning("%s: it is skipped", self.unmatched)
            return
        self._matched = True
        trial = LiveTrial(info.trial_id, actors, info.last_state)
        retry = _Retry(f"reading trial {info.trial_id}", self._timeout_s)
        while True:
            retry.attempting()
            # An attempt of its own: given up on with its datastore (see `_follower_done`).
            attempt = asyncio.create_task(self._read_from(endpoint, trial, retry))
            reads = self._reads.setdefault(endpoint, set())
            reads.add(attempt)
            try:
                await attempt
                break
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the feed stops
                log.warning("reading trial %s again elsewhere: %s does not answer", info.trial_id, endpoint)
                endpoint = self._another(endpoint)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("trial %s was deleted while read: its steps end here", info.trial_id)
                    break
                await retry.failed(error)
                endpoint = self._another(endpoint)
            finally:
                reads.discard(attempt)
        trial.finish(self._buffer, self._observations, self._actions)

    async def _read_from(self, endpoint: str, trial: LiveTrial, retry: _Retry) -> None:
        """The trial's samples from `endpoint` into the buffer, after those already in it."""
        samples_in = self._samples(self._client(endpoint), trial.trial_id, trial.samples_read)
        async with contextlib.aclosing(samples_in):  # its stream and reader stop with the read
            async for samples in samples_in:
                retry.progressed()  # an answer, be it empty (a wait for an idle trial's samples)
                if samples:
                    await self._add(trial, samples)

    def _another(self, endpoint: str) -> str:
        """The next datastore followed after `endpoint`, to try a read again on."""
        others = sorted(self._followers)
        return next((other for other in others if other > endpoint), others[0] if others else endpoint)

    async def _add(self, trial: LiveTrial, samples: Sequence[trial_datastore_pb2.StoredTrialSample]) -> None:
        """Into the buffer within the rate limiter's room: a sample's actors go in together, so
        they wait for room for all of them (or the most there can be)."""
        assert self._room is not None
        largest = self._buffer.largest_insert_room()
        needed = len(trial.actors) if largest is None else max(1, min(len(trial.actors), largest))
        while samples:
            waited_since = time.monotonic()
            while True:
                self._room.clear()  # before looking: a change after it sets it again
                room = self._buffer.insert_room()
                if room is None or room >= needed:
                    break
                await self._room.wait()
            self._buffer.inserts_waited(time.monotonic() - waited_since)
            count = len(samples) if room is None else max(1, room // len(trial.actors))
            trial.add(self._buffer, samples[:count], self._observations, self._actions)
            samples = samples[count:]

    async def _samples(
        self, client: DatastoreClient, trial_id: str, skip: int
    ) -> AsyncGenerator[Sequence[trial_datastore_pb2.StoredTrialSample], None]:
        """The trial's samples in stored order after the first `skip`, in lists (empty: a range
        that waited for an idle trial in vain): in ranges of up to `RANGE_SAMPLES`
        (`RetrieveSampleRange`), the datastore waiting for a running trial's next ones (a range
        costs about what one sample of a stream does, and holds all there are); from a datastore
        that serves no ranges (the reference's) or cannot wait (an earlier release), as they are
        committed (`RetrieveSamples`)."""
        while True:
            reply = await client.sample_range(trial_id, skip, RANGE_SAMPLES, wait_ms=RANGE_WAIT_MS)
            if reply is None:
                break
            yield reply.samples
            skip = reply.first + len(reply.samples)
            if not reply.HasField("finished"):
                break  # an earlier release, which answered at once: its stream follows the rest
            if reply.finished and skip >= reply.samples_count:
                return
        call = client.stub.RetrieveSamples(trial_datastore_pb2.RetrieveSamplesRequest(trial_ids=[trial_id]))
        try:
            async for replies in _batches(call, BATCH_SAMPLES, LINGER_S):
                samples = [reply.trial_sample for reply in replies[skip:]]
                skip = max(0, skip - len(replies))
                if samples:
                    yield samples
        finally:
            call.cancel()
