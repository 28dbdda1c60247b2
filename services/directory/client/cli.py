"""`cogment-aux client directory <command> [flags]` (or `python -m services.directory.client`):
the reference's `cogment client directory register|deregister|inquire|WaitForReady`, over
`services.directory.client.api`.

Flags shared by every command (before or after the command name):
`--directory_endpoint` (`COGMENT_DIRECTORY_ENDPOINT`, default `grpc://localhost:9005`, alias
`--endpoint`), `--directory_authentication_token` (`COGMENT_DIRECTORY_AUTHENTICATION_TOKEN`, alias
`--auth_token`), `--timeout` (`COGMENT_CLIENT_TIMEOUT`, seconds or a Go-style duration such as
`30s`, `1m30s`, `500ms`; default 30 s) and `--console_output` (`COGMENT_CLIENT_CONSOLE_OUTPUT`,
`text` or `json`), and the TLS flags (`--tls_ca`, `--tls_cert`, `--tls_key`: `shared.cli`).

`wait_for_ready` waits for the directory to be reachable until the timeout; the other commands
fail at once when it cannot be reached (as the registry's and datastore's clients do).
Exit codes: 0 success; 1 failure (directory unreachable, or not answering within the timeout,
registration or deregistration refused, other gRPC errors); 2 invalid flags or environment
variables.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TextIO

from services.directory.client.api import DEFAULT_ENDPOINT, DirectoryClient
from shared.api import directory_pb2
from shared.cli import (
    CONSOLE_OUTPUT_OPTION,
    ClientProgram,
    Command,
    Context,
    Usage,
    Values,
    endpoint_arg,
    properties_arg,
    timeout_option,
    tls_of,
    to_json,
)
from shared.client import ClientError
from shared.config import Option, parse_bool, port_number
from shared.endpoints import (
    SERVICE_TYPES,
    format_host,
    parse_service_type,
    service_type_name,
)
from shared.version import PACKAGE_VERSION

# Added to every registration made with this client, as the reference does.
CLIENT_PROPERTIES = {"__registration_source": "Cogment-Command_Line", "__version": PACKAGE_VERSION}
TYPE_NAMES = ", ".join(SERVICE_TYPES)
MAX_UINT64 = 2**64 - 1


# ---- option value parsers ----


def service_type_arg(text: str) -> int:
    try:
        return int(parse_service_type(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def service_id_arg(text: str) -> int:
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_UINT64:
        raise argparse.ArgumentTypeError(f"invalid service id {text!r}: expected an unsigned 64-bit integer")
    return int(value)


# ---- options ----

COMMON_OPTIONS: list[Option] = [
    Option(
        "directory_endpoint",
        "the directory gRPC endpoint URL",
        DEFAULT_ENDPOINT,
        "COGMENT_DIRECTORY_ENDPOINT",
        endpoint_arg,
        aliases=["endpoint"],
    ),
    Option(
        "directory_authentication_token",
        "the authentication token of the services in the directory",
        "",
        "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN",
        aliases=["auth_token"],
    ),
    timeout_option("timeout of the operation, in seconds or as a duration (30s, 1m30s, 500ms)"),
    CONSOLE_OUTPUT_OPTION,
]

TYPE_OPTION_HELP = f"service type ({TYPE_NAMES})"
PROPERTIES_HELP = "service properties, as 'name=value,name2=value2'"

REGISTER_OPTIONS: list[Option] = [
    Option("host", "host of the service to register", ""),
    Option("port", "TCP port of the service to register", 0, parse=port_number),
    Option("protocol", "protocol of the service", "grpc", parse=str.lower, choices=["grpc", "cogment"]),
    Option("ssl_required", "the service requires SSL (grpc protocol only)", False, parse=parse_bool),
    Option("type", TYPE_OPTION_HELP, None, parse=service_type_arg),
    Option("properties", PROPERTIES_HELP, {}, parse=properties_arg),
    Option("permanent", "register permanently: never health-checked", False, parse=parse_bool),
]
DEREGISTER_OPTIONS: list[Option] = [
    Option("service_id", "id of the service to deregister", None, parse=service_id_arg),
    Option("secret", "secret returned by its registration", ""),
]
INQUIRE_OPTIONS: list[Option] = [
    Option("service_id", "id of the service to find (not with --type/--properties)", 0, parse=service_id_arg),
    Option("type", f"{TYPE_OPTION_HELP}; default: any type", None, parse=service_type_arg),
    Option("properties", f"{PROPERTIES_HELP}; the services must have them all", None, parse=properties_arg),
]


# ---- output ----


def endpoint_text(endpoint: directory_pb2.ServiceEndpoint) -> tuple[str, bool]:
    """The reference's rendering of a service endpoint, and whether it requires SSL."""
    schemes = {
        directory_pb2.ServiceEndpoint.GRPC: ("grpc", False),
        directory_pb2.ServiceEndpoint.GRPC_SSL: ("grpc", True),
        directory_pb2.ServiceEndpoint.COGMENT: ("cogment", False),
    }
    scheme, ssl = schemes.get(endpoint.protocol, ("<unknown>", False))
    text = f"{scheme}://{format_host(endpoint.host)}"
    if endpoint.port:
        text += f":{endpoint.port}"
    return text, ssl


def print_services(services: Sequence[directory_pb2.FullServiceData], out: TextIO) -> None:
    print(f"[{len(services)}] Services found", file=out)
    for service in services:
        endpoint, ssl = endpoint_text(service.endpoint)
        print(f"Service ID [{service.service_id}]", file=out)
        print(f"\tEndpoint [{endpoint}] SSL required [{str(ssl).lower()}]", file=out)
        print(f"\tType [{service_type_name(service.details.type)}]", file=out)
        print(f"\tPermanent [{str(service.permanent).lower()}]", file=out)
        for name, value in sorted(service.details.properties.items()):
            print(f"\t[{name}] = [{value}]", file=out)


# ---- commands ----

DirectoryContext = Context[DirectoryClient]


def check_register(values: Values, usage: Usage) -> None:
    if values["type"] is None:
        usage(f"register needs --type ({TYPE_NAMES})")
    if values["type"] == directory_pb2.UNKNOWN_SERVICE:
        usage(f"register needs a service type ({TYPE_NAMES})")
    if values["ssl_required"] and values["protocol"] != "grpc":
        usage("--ssl_required only applies to --protocol grpc")


async def run_register(context: DirectoryContext) -> None:
    client, values, out = context.client, context.values, context.out
    if values["protocol"] == "cogment":
        protocol = directory_pb2.ServiceEndpoint.COGMENT
    elif values["ssl_required"]:
        protocol = directory_pb2.ServiceEndpoint.GRPC_SSL
    else:
        protocol = directory_pb2.ServiceEndpoint.GRPC
    request = directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(protocol=protocol, host=values["host"], port=values["port"]),
        details=directory_pb2.ServiceDetails(
            type=values["type"], properties={**values["properties"], **CLIENT_PROPERTIES}
        ),
        permanent=values["permanent"],
    )
    reply = await client.register(request)
    if reply.status != directory_pb2.RegisterReply.OK:
        raise ClientError(f"Service registration failed [{reply.error_msg}]")
    if context.json:
        print(json.dumps(to_json(reply)), file=out)
    else:
        print(f"Service ID [{reply.service_id}] \tSecret [{reply.secret}]", file=out)


def check_deregister(values: Values, usage: Usage) -> None:
    if values["service_id"] is None:
        usage("deregister needs --service_id")


async def run_deregister(context: DirectoryContext) -> None:
    client, values, out = context.client, context.values, context.out
    request = directory_pb2.DeregisterRequest(service_id=values["service_id"], secret=values["secret"])
    reply = await client.deregister(request)
    if reply.status != directory_pb2.DeregisterReply.OK:
        raise ClientError(f"Service deregistration failed [{reply.error_msg}]")
    if context.json:
        print(json.dumps(to_json(reply)), file=out)


def check_inquire(values: Values, usage: Usage) -> None:
    if values["service_id"] and (values["type"] is not None or values["properties"] is not None):
        usage("Can only inquire with a service ID or type/properties, not both")


async def run_inquire(context: DirectoryContext) -> None:
    client, values, out = context.client, context.values, context.out
    if values["service_id"]:
        request = directory_pb2.InquireRequest(service_id=values["service_id"])
    else:
        request = directory_pb2.InquireRequest(
            details=directory_pb2.ServiceDetails(
                type=values["type"] or directory_pb2.UNKNOWN_SERVICE, properties=values["properties"] or {}
            )
        )
    services = await client.inquire(request)
    if context.json:
        print(json.dumps({"services": [to_json(service) for service in services]}), file=out)
    else:
        print_services(services, out)


async def run_wait_for_ready(context: DirectoryContext) -> None:
    await context.client.wait_for_ready()
    endpoint = str(context.client.endpoint)
    if context.json:
        print(json.dumps({"ready": True, "endpoint": endpoint}), file=context.out)
    else:
        print(f"The directory at {endpoint} is ready", file=context.out)


PROGRAM = ClientProgram(
    prog="python -m services.directory.client",
    description="Cogment Directory command-line client.",
    options=COMMON_OPTIONS,
    commands=[
        Command(
            "register",
            "register a service in the directory",
            run_register,
            REGISTER_OPTIONS,
            check=check_register,
        ),
        Command(
            "deregister",
            "remove a service from the directory",
            run_deregister,
            DEREGISTER_OPTIONS,
            check=check_deregister,
        ),
        Command(
            "inquire", "find services in the directory", run_inquire, INQUIRE_OPTIONS, check=check_inquire
        ),
        Command(
            "wait_for_ready",
            "wait until the directory answers (exit code 1 on timeout)",
            run_wait_for_ready,
            aliases=("WaitForReady",),
        ),
    ],
    connect=lambda values: DirectoryClient(
        values["directory_endpoint"],
        values["directory_authentication_token"],
        values["timeout"],
        tls_of(values),
    ),
)
main = PROGRAM.main
