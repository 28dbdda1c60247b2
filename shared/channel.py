"""Client channels to a service: plaintext, or TLS with the server's certificate checked and, for
servers that require one (mTLS), a client certificate. Used by the clients and by the services'
self-registration in a directory."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.endpoints import GrpcEndpoint
from shared.tls_files import ENCRYPTED_KEY, ca_error, key_pair_error


class TlsFileError(OSError):
    """A TLS file that was read but cannot be used: not PEM, or a key that is not the
    certificate's. `strerror` is the whole sentence, naming the file (`filename`)."""

    def __init__(self, filename: str, message: str) -> None:
        super().__init__(errno.EINVAL, message, filename)


@dataclass(frozen=True)
class ClientTls:
    """PEM files of a TLS connection, read when a channel opens: `ca`, the CA bundle the server's
    certificate is checked against (empty: the system's CAs); `cert` and `key`, the client's
    certificate and key for a server that requires one (both or neither)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises OSError (naming the file) when one cannot be read, TlsFileError when one
        cannot be used."""
        ca = Path(self.ca).read_bytes() if self.ca else None
        cert = Path(self.cert).read_bytes() if self.cert else None
        key = Path(self.key).read_bytes() if self.key else None
        self.check()
        return grpc.ssl_channel_credentials(ca, key, cert)

    def check(self) -> None:
        """Raise a TlsFileError naming the file that is not PEM, the key that is not the
        certificate's or is encrypted: grpc would accept them, then fail every connection with
        "Failed to create security handshaker" after printing its own log lines."""
        if self.ca and ca_error(self.ca) is not None:
            raise TlsFileError(self.ca, f"[{self.ca}] is not a PEM CA bundle")
        if self.cert and ca_error(self.cert) is not None:  # a certificate reads as a bundle of one
            raise TlsFileError(self.cert, f"[{self.cert}] is not a PEM certificate")
        if self.cert and (reason := key_pair_error(self.cert, self.key)) is not None:
            if reason == ENCRYPTED_KEY:
                raise TlsFileError(self.key, f"[{self.key}]: {ENCRYPTED_KEY}")
            raise TlsFileError(
                self.key, f"[{self.key}] is not the PEM private key of the certificate [{self.cert}]"
            )


def tls_for(endpoint: GrpcEndpoint, tls: ClientTls | None) -> ClientTls | None:
    """The TLS of a connection to `endpoint`: `tls` when given, the system's CAs for a `grpcs://`
    endpoint without it, else none (plaintext)."""
    if tls is None and endpoint.tls:
        return ClientTls()
    return tls


def open_channel(
    endpoint: GrpcEndpoint, tls: ClientTls | None, options: Sequence[tuple[str, int | str]] = ()
) -> grpc.aio.Channel:
    """A channel to `endpoint`, over TLS when `tls_for` says so. Raises OSError (naming the file)
    when a TLS file cannot be read."""
    chosen = tls_for(endpoint, tls)
    if chosen is None:
        return grpc.aio.insecure_channel(endpoint.address, options=list(options))
    return grpc.aio.secure_channel(endpoint.address, chosen.credentials(), options=list(options))
