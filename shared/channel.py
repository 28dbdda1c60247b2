"""Client channels to a service: plaintext, or TLS with the server's certificate checked and, for
servers that require one (mTLS), a client certificate. Used by the clients and by the services'
self-registration in a directory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.endpoints import GrpcEndpoint


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
        """Raises OSError (naming the file) when one cannot be read."""
        ca = Path(self.ca).read_bytes() if self.ca else None
        cert = Path(self.cert).read_bytes() if self.cert else None
        key = Path(self.key).read_bytes() if self.key else None
        return grpc.ssl_channel_credentials(ca, key, cert)


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
