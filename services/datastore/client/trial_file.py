"""The trial export file of `cogment client datastore export|import`, byte-compatible with the
reference CLI's (docs/compatibility.md#export-file).

Layout: the 16 ASCII bytes `COGMENTTRIALS001`, a length-prefixed `TrialSamplesFileHeader`, then
length-prefixed `StoredTrialSample`s until the end of the file. Each prefix is the serialized
message's byte length, an unsigned 32-bit little-endian integer.

Files are streamed one message at a time: exports can be far larger than memory. The reader
loops on short reads, which pipes and standard input deliver (the reference reader assumed one
`Read` returns a whole message), and reads large messages in bounded pieces, so a corrupted
length fails as a truncated file instead of allocating up to 4 GiB first.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from typing import BinaryIO, TypeVar

from google.protobuf.message import DecodeError, Message

from shared.api import common_pb2, trial_datastore_pb2
from shared.version import PACKAGE_VERSION

MAGIC = b"COGMENTTRIALS001"
LENGTH_PREFIX = struct.Struct("<I")
READ_PIECE = 1024 * 1024  # largest single read

M = TypeVar("M", bound=Message)


class TrialFileError(Exception):
    """The input is not a well-formed trial export file; the message says where and why."""


def file_header(
    trial_params: Mapping[str, common_pb2.TrialParams],
) -> trial_datastore_pb2.TrialSamplesFileHeader:
    """The header of an export of these trials, written now by this version."""
    return trial_datastore_pb2.TrialSamplesFileHeader(
        version_info=common_pb2.VersionInfo(
            versions=[common_pb2.VersionInfo.Version(name="cogment", version=PACKAGE_VERSION)]
        ),
        export_timestamp=time.time_ns(),
        trial_params=trial_params,
    )


class TrialFileWriter:
    """Writes a trial export file to `sink`; `bytes_written` counts what was written."""

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self.bytes_written = 0

    def write_header(self, header: trial_datastore_pb2.TrialSamplesFileHeader) -> None:
        self._write(MAGIC)
        self._write_message(header.SerializeToString(deterministic=True))

    def write_sample(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        self._write_message(sample.SerializeToString())

    def _write_message(self, data: bytes) -> None:
        self._write(LENGTH_PREFIX.pack(len(data)))
        self._write(data)

    def _write(self, data: bytes) -> None:
        self._sink.write(data)
        self.bytes_written += len(data)


class TrialFileReader:
    """Reads a trial export file from a blocking binary stream: `read_header()` first, then
    `read_sample()` until it returns None. `bytes_read` counts what was consumed."""

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self.bytes_read = 0
        self._samples_read = 0
        self._error: TrialFileError | None = None

    def read_header(self) -> trial_datastore_pb2.TrialSamplesFileHeader:
        magic = self._read_exact(len(MAGIC))
        if magic != MAGIC:
            what = "the input is empty" if not magic else f"it starts with {magic!r}"
            raise TrialFileError(
                f"not a Cogment trial samples file: {what}, expected {MAGIC.decode('ascii')}"
            )
        data = self._read_message("the header", at_end_ok=False)
        assert data is not None
        return self._parse(trial_datastore_pb2.TrialSamplesFileHeader, data, "the header")

    def read_sample(self) -> trial_datastore_pb2.StoredTrialSample | None:
        """The next sample; None at the end of the file."""
        what = f"sample #{self._samples_read + 1}"
        data = self._read_message(what, at_end_ok=True)
        if data is None:
            return None
        self._samples_read += 1
        return self._parse(trial_datastore_pb2.StoredTrialSample, data, what)

    def read_samples(self, limit: int) -> list[trial_datastore_pb2.StoredTrialSample]:
        """Up to `limit` next samples; fewer only at the end of the file. A malformed sample
        raises TrialFileError once the samples before it were returned."""
        if self._error is not None:
            raise self._error
        samples: list[trial_datastore_pb2.StoredTrialSample] = []
        try:
            while len(samples) < limit and (sample := self.read_sample()) is not None:
                samples.append(sample)
        except TrialFileError as error:
            if not samples:
                raise
            self._error = error  # for the next call
        return samples

    def _read_message(self, what: str, *, at_end_ok: bool) -> bytes | None:
        offset = self.bytes_read
        prefix = self._read_exact(LENGTH_PREFIX.size)
        if not prefix and at_end_ok:
            return None
        if len(prefix) < LENGTH_PREFIX.size:
            raise TrialFileError(
                f"truncated file: the length of {what} at byte {offset} has {len(prefix)} of "
                f"{LENGTH_PREFIX.size} bytes"
            )
        (length,) = LENGTH_PREFIX.unpack(prefix)
        data = self._read_exact(length)
        if len(data) < length:
            raise TrialFileError(
                f"truncated file: {what} at byte {offset} has {len(data)} of its {length} bytes"
            )
        return data

    def _read_exact(self, count: int) -> bytes:
        """`count` bytes, or fewer only at the end of the input."""
        pieces: list[bytes] = []
        missing = count
        while missing:
            piece = self._source.read(min(missing, READ_PIECE))
            if not piece:
                break
            pieces.append(piece)
            missing -= len(piece)
        data = b"".join(pieces)
        self.bytes_read += len(data)
        return data

    def _parse(self, message_type: type[M], data: bytes, what: str) -> M:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            end = self.bytes_read
            raise TrialFileError(
                f"{what} ({len(data)} bytes ending at byte {end}) is not a valid "
                f"{message_type.DESCRIPTOR.name} message: {error}"
            ) from None
