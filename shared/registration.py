"""Self-registration of a service in a Cogment Directory (the reference's
`CLI/clients/directory/manageRegistration.go`), as the Model Registry and Trial Datastore do it:
its options and settings here, the registration itself in `shared.directory_registration`, the
discovery of the host to register in `shared.host_discovery`.

Wiring in a `shared.server.Service`::

    OPTIONS = [*server_options(ENV_PREFIX, DEFAULT_PORT), *registration_options("MODEL_REGISTRY"), ...]

    def __init__(self, settings):  # settings: ServerSettings and RegistrationSettings
        ...
        self.registration = self.directory_registration([directory_pb2.MODEL_REGISTRY_SERVICE])

`serve()` starts a service's `registration` once its port is open, and stops it (deregistering,
within half the shutdown grace) when shutdown begins.

Behaviour:
* No `--directory_endpoint` (the default): nothing happens.
* `start(port)` returns at once; a background task registers every service type on one Register
  stream: protocol GRPC (GRPC_SSL when the service serves TLS), the bound port, `permanent=false`,
  metadata `authentication-token` when a token is configured, the configured properties plus
  `__registration_source` and `__version`. While the directory cannot be reached it keeps trying
  (wait-for-ready calls, reconnection backoff capped at a few seconds), logging a warning at first
  and then about once a minute. A FAILED reply (the directory refused the request) is logged as an
  error and not retried.
* Host: `--directory_registration_host` when given (`__registration_source=Self-Command_Line`);
  otherwise (`Self-Implicit`) the service's specific bind address if it has one, else
  self-discovery: the first non-loopback IPv4 address of the host name (as the reference), else the
  local address of the route to the directory if that is not loopback. When all fail, the
  reference exits; here an error is logged and the service keeps serving, unregistered.
* TLS: with `--directory_tls_ca` the directory is reached over TLS, its certificate checked
  against that CA bundle (without it, a `grpcs://` endpoint or a client certificate: against the
  system's CAs);
  `--directory_tls_cert` and `--directory_tls_key` add a client certificate for a directory that
  requires one (mTLS). An unreadable file is logged as an error
  and the service keeps serving, unregistered. (The reference only spoke plaintext.)
* `stop()` cancels a registration still in progress and deregisters every registration made, on
  one Deregister stream with a 10 s deadline (or the shorter one the caller gives); failures are
  only logged.
* Restarts: with a `state_file` (the services keep it in their data directory, mode 0600: it
  holds secrets), the registrations not yet deregistered are written there. A process that starts
  after one that died (kill -9, a crash) first deregisters what its predecessor left, so the
  directory does not list the endpoint twice (the old entry would keep passing its health checks,
  the new process answering on its port). A registration the
  directory accepted but whose reply was cut off by `stop()` is not known here; as it is not
  permanent, the directory's health checks remove it once the service is gone.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.config import Option
from shared.endpoints import parse_grpc_endpoint
from shared.settings import Settings


def grpc_endpoint_or_empty(text: str) -> str:
    """Option parser for `--directory_endpoint`: empty, or a valid `grpc://host:port` URL."""
    text = text.strip()
    if text:
        try:
            parse_grpc_endpoint(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def registration_options(service_env_name: str) -> list[Option]:
    """The reference's self-registration options for one service.

    `service_env_name` is the `<SVC>` part of `COGMENT_<SVC>_DIRECTORY_REGISTRATION_HOST`, e.g.
    `MODEL_REGISTRY` or `TRIAL_DATASTORE`; a full prefix such as `COGMENT_MODEL_REGISTRY` works too.
    """
    name = service_env_name.strip("_").upper()
    prefix = name if name.startswith("COGMENT_") else f"COGMENT_{name}"
    return [
        Option(
            "directory_endpoint",
            "grpc://host:port of a Cogment Directory to register in (empty: no registration)",
            "",
            "COGMENT_DIRECTORY_ENDPOINT",
            grpc_endpoint_or_empty,
        ),
        Option(
            "directory_authentication_token",
            "authentication token of the directory registration",
            "",
            "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN",
        ),
        Option(
            "directory_registration_host",
            "host registered in the directory (default: the bind address if specific, else discovered)",
            "",
            f"{prefix}_DIRECTORY_REGISTRATION_HOST",
        ),
        Option(
            "directory_registration_properties",
            "properties registered in the directory, as 'name=value,name2=value2' "
            "(an unparsable value is ignored with a warning)",
            "",
            f"{prefix}_DIRECTORY_REGISTRATION_PROPERTIES",
        ),
        Option(
            "directory_tls_ca",
            "PEM CA bundle to check the directory's certificate with: reach it over TLS",
            "",
            f"{prefix}_DIRECTORY_TLS_CA",
        ),
        Option(
            "directory_tls_cert",
            "PEM client certificate presented to a directory that requires one (mTLS)",
            "",
            f"{prefix}_DIRECTORY_TLS_CERT",
        ),
        Option(
            "directory_tls_key",
            "PEM private key of the client certificate",
            "",
            f"{prefix}_DIRECTORY_TLS_KEY",
        ),
    ]


@dataclass(frozen=True)
class RegistrationSettings(Settings):
    """The options of `registration_options()`."""

    directory_endpoint: str
    directory_authentication_token: str
    directory_registration_host: str
    directory_registration_properties: str
    directory_tls_ca: str
    directory_tls_cert: str
    directory_tls_key: str
