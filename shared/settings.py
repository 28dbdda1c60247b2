"""Settings every server has, typed.

A service's configuration is its `Option` table (flags, environment variables, defaults, see
`shared.config`) read into a frozen dataclass whose fields are the options' names: code reads
`settings.port`, never `values["port"]`. `from_values` refuses values that do not match the
fields one for one, so the table and the class cannot drift apart. A settings class names its
table (`options`), so that code builds settings without a command line: `with_defaults(port=0)`
is every option's default but the port.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from shared.config import Option, parse_bool, port_number, positive_float
from shared.db import DEFAULT_DATA_DIR, default_database_url
from shared.dependencies import DEFAULT_OUTAGE_BOUND_S
from shared.logging import logging_options

S = TypeVar("S", bound="Settings")


@dataclass(frozen=True)
class Settings:
    """Base of the typed settings: fields named as the options they are read from."""

    # The option table the fields are read from.
    options: ClassVar[Sequence[Option]] = ()

    @classmethod
    def from_values(cls: type[S], values: Mapping[str, Any]) -> S:
        names = {field.name for field in fields(cls)}
        if names != set(values):
            raise ValueError(
                f"{cls.__name__} does not match its options: missing {sorted(names - set(values))}, "
                f"unknown {sorted(set(values) - names)}"
            )
        return cls(**values)

    @classmethod
    def with_defaults(cls: type[S], **values: Any) -> S:
        """The settings of every option's default, but `values` (typed, by option name)."""
        defaults = {option.flag: option.default for option in cls.options}
        unknown = sorted(set(values) - set(defaults))
        if unknown:
            raise TypeError(f"{cls.__name__} has no option {', '.join(unknown)}")
        return cls.from_values({**defaults, **values})


@dataclass(frozen=True)
class ServerSettings(Settings):
    """The options of `server_options()`."""

    port: int
    bind_address: str
    grpc_reflection: bool
    health_port: int | None
    metrics_port: int | None
    data_dir: str
    database_url: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_client_ca: str | None
    shutdown_grace: float
    outage_bound: float
    log_level: str
    log_format: str
    log_file: str | None

    def database_url_of(self, service: str) -> str:
        """The configured database URL, else the service's SQLite file in the data directory."""
        return self.database_url or default_database_url(self.data_dir, service)


def server_options(env_prefix: str, default_port: int) -> list[Option]:
    """Options every service has (`ServerSettings`); `env_prefix` is e.g. `COGMENT_DIRECTORY`."""
    return [
        Option(
            "port",
            "gRPC port to listen on; 0 picks a free port",
            default_port,
            f"{env_prefix}_PORT",
            port_number,
        ),
        Option(
            "bind_address",
            # Loopback by default: what a quick start serves is not reachable from other machines
            # until asked (the chart and the image set 0.0.0.0 explicitly).
            "address to listen on, also of --health_port and --metrics_port; 0.0.0.0 serves other machines",
            "127.0.0.1",
            f"{env_prefix}_BIND_ADDRESS",
        ),
        Option(
            "grpc_reflection", "serve gRPC reflection", False, f"{env_prefix}_GRPC_REFLECTION", parse_bool
        ),
        Option(
            "health_port",
            "also serve grpc.health.v1, in plaintext, on this port (for Kubernetes' gRPC probes, "
            "which cannot speak TLS); off when unset",
            None,
            f"{env_prefix}_HEALTH_PORT",
            port_number,
        ),
        Option(
            "metrics_port",
            "serve Prometheus metrics over HTTP on this port (off when unset)",
            None,
            f"{env_prefix}_METRICS_PORT",
            port_number,
        ),
        Option(
            "data_dir",
            "directory of the embedded database and local files (created if missing)",
            DEFAULT_DATA_DIR,
            f"{env_prefix}_DATA_DIR",
        ),
        Option(
            "database_url",
            "SQLAlchemy URL: sqlite+aiosqlite:///FILE or postgresql+psycopg://... "
            "(default: an SQLite file in the data directory)",
            None,
            f"{env_prefix}_DATABASE_URL",
        ),
        Option("tls_cert", "PEM server certificate file: serve TLS", None, f"{env_prefix}_TLS_CERT"),
        Option("tls_key", "PEM private key file of the server certificate", None, f"{env_prefix}_TLS_KEY"),
        Option(
            "tls_client_ca",
            "PEM CA bundle: require client certificates signed by it (mTLS)",
            None,
            f"{env_prefix}_TLS_CLIENT_CA",
        ),
        Option(
            "shutdown_grace",
            "seconds given on shutdown to deregistering from a directory (half at most), then to "
            "in-flight calls; what was received is written after",
            5.0,
            f"{env_prefix}_SHUTDOWN_GRACE",
            positive_float,
        ),
        Option(
            "outage_bound",
            "seconds streams (live reads, ingestion, VersionUpdate), registrations and version "
            "commits wait for the database or blob store to come back before failing with UNAVAILABLE",
            DEFAULT_OUTAGE_BOUND_S,
            f"{env_prefix}_OUTAGE_BOUND",
            positive_float,
        ),
        *logging_options(),
    ]
