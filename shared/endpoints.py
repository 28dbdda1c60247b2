"""Directory endpoint URLs, property strings and service type names, in the reference's syntax.

* `grpc://host:port` endpoint URLs (the reference's `CLI/utils/endpoint/endpoint.go`): an IPv6 host
  goes in brackets (`grpc://[::1]:9005`); no path, query, fragment or user information. Unlike
  the reference, port 0 (which nothing can connect to) is refused, and `grpcs://host:port` names
  a server reached over TLS.
* Property strings `name=value,name2,...` (`CLI/utils/propertiesSerialization.go`): split on
  commas, then on `=`; names and values are trimmed; a bare name means an empty value; empty
  segments are skipped; a later duplicate wins; more than one `=`, or an empty name with `=`, is
  an error.
* Service type names of discovery URLs and the command-line client (`actor`, `environment`, ...).

Errors are `ValueError`s whose message names the offending text and the expected form.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from shared.api import directory_pb2

GRPC_SCHEME = "grpc"
GRPC_TLS_SCHEME = "grpcs"
EXPECTED_ENDPOINT = "expected grpc://<host>:<port> (grpcs:// over TLS)"
_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")

ServiceType: TypeAlias = directory_pb2.ServiceType.ValueType

# Reference names (`CLI/utils/constants/ServiceTypes.go`), in the reference's order.
SERVICE_TYPES: dict[str, ServiceType] = {
    "actor": directory_pb2.ACTOR_SERVICE,
    "environment": directory_pb2.ENVIRONMENT_SERVICE,
    "prehook": directory_pb2.PRE_HOOK_SERVICE,
    "datalog": directory_pb2.DATALOG_SERVICE,
    "lifecycle": directory_pb2.TRIAL_LIFE_CYCLE_SERVICE,
    "actservice": directory_pb2.CLIENT_ACTOR_CONNECTION_SERVICE,
    "datastore": directory_pb2.DATASTORE_SERVICE,
    "modelregistry": directory_pb2.MODEL_REGISTRY_SERVICE,
    "directory": directory_pb2.DIRECTORY_SERVICE,
    "other": directory_pb2.OTHER_SERVICE,
}
_SERVICE_TYPE_NAMES: dict[int, str] = {int(value): name for name, value in SERVICE_TYPES.items()}


@dataclass(frozen=True)
class GrpcEndpoint:
    """A parsed `grpc://host:port` URL (`grpcs://`: `tls`); `host` never has brackets."""

    host: str
    port: int
    tls: bool = False

    @property
    def address(self) -> str:
        """`host:port` as gRPC channels take it (`[::1]:9005` for IPv6)."""
        return f"{format_host(self.host)}:{self.port}"

    @property
    def url(self) -> str:
        return f"{GRPC_TLS_SCHEME if self.tls else GRPC_SCHEME}://{self.address}"

    def __str__(self) -> str:
        return self.url


def format_host(host: str) -> str:
    """`host` as it goes before `:port`: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host else host


def _invalid(text: str, why: str) -> ValueError:
    return ValueError(f"invalid endpoint [{text}]: {why}, {EXPECTED_ENDPOINT}")


def parse_grpc_endpoint(text: str) -> GrpcEndpoint:
    """Parse a `grpc://host:port` or `grpcs://host:port` URL (surrounding blanks and one trailing
    `/` are tolerated)."""
    url = text.strip()
    if not url:
        raise ValueError(f"empty endpoint, {EXPECTED_ENDPOINT}")
    scheme, separator, rest = url.partition("://")
    if not separator:
        raise _invalid(text, "no scheme")
    scheme = scheme.lower()
    if scheme == "cogment":
        raise _invalid(text, "cogment:// (discovery or client) endpoints cannot be used here")
    if scheme not in (GRPC_SCHEME, GRPC_TLS_SCHEME):
        raise _invalid(text, f"unexpected scheme [{scheme}]")
    rest = rest.removesuffix("/")
    for character, what in (("/", "path"), ("?", "query"), ("#", "fragment"), ("@", "user information")):
        if character in rest:
            raise _invalid(text, f"unexpected {what}")

    if rest.startswith("["):
        host, bracket, after = rest[1:].partition("]")
        if not bracket:
            raise _invalid(text, "unclosed '[' around an IPv6 host")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _invalid(text, f"invalid IPv6 address [{host}]") from None
        if not after.startswith(":"):
            raise _invalid(text, "missing port")
        port_text = after[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise _invalid(text, "missing port")
        if ":" in host:
            raise _invalid(text, "an IPv6 host goes in brackets, as in grpc://[::1]:9005")
        if not host:
            raise _invalid(text, "missing host")
        if not _HOSTNAME.fullmatch(host):
            raise _invalid(text, f"invalid host [{host}]")

    if not port_text:
        raise _invalid(text, "missing port")
    if not (port_text.isascii() and port_text.isdigit()):
        raise _invalid(text, f"invalid port [{port_text}]")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _invalid(text, f"port [{port_text}] out of range 1..65535")
    return GrpcEndpoint(host, port, tls=scheme == GRPC_TLS_SCHEME)


def parse_properties(text: str) -> dict[str, str]:
    """Parse `name=value,name2,...` (see the module documentation for the rules)."""
    properties: dict[str, str] = {}
    for segment in text.split(","):
        parts = segment.strip().split("=")
        if len(parts) > 2:
            raise ValueError(f"invalid property [{segment.strip()}]: more than one '='")
        name = parts[0].strip()
        if not name:
            if len(parts) == 1:
                continue  # an empty segment
            raise ValueError(f"invalid property [{segment.strip()}]: empty name")
        properties[name] = parts[1].strip() if len(parts) == 2 else ""
    return properties


def format_properties(properties: Mapping[str, str]) -> str:
    """The property string `parse_properties` reads back as `properties` (a bare name for an
    empty value). Raises ValueError for names or values that cannot round-trip."""
    segments = []
    for name, value in properties.items():
        if not name:
            raise ValueError("cannot format a property with an empty name")
        for what, text in (("name", name), ("value", value)):
            if "," in text or "=" in text or text != text.strip():
                raise ValueError(
                    f"cannot format property {what} [{text}]: "
                    "',', '=' and surrounding blanks do not round-trip"
                )
        segments.append(f"{name}={value}" if value else name)
    return ",".join(segments)


def parse_service_type(name: str) -> ServiceType:
    """A service type name (case-insensitive) → `ServiceType`; an empty name is UNKNOWN_SERVICE
    (which inquiries read as "any type")."""
    key = name.strip().lower()
    if not key:
        return directory_pb2.UNKNOWN_SERVICE
    try:
        return SERVICE_TYPES[key]
    except KeyError:
        raise ValueError(
            f"invalid service type [{name}], expected one of {', '.join(SERVICE_TYPES)}"
        ) from None


def service_type_name(value: int) -> str:
    """The name of a `ServiceType` value: empty for UNKNOWN_SERVICE, `<unknown N>` if not a type."""
    if value == directory_pb2.UNKNOWN_SERVICE:
        return ""
    return _SERVICE_TYPE_NAMES.get(value, f"<unknown {value}>")
