"""Finding the address this machine is reached at, for a service that registers itself in a
directory without being told its host (`shared.directory_registration`): the reference's way
first, then the route to the directory."""

from __future__ import annotations

import ipaddress
import socket

from shared.endpoints import GrpcEndpoint
from shared.logging import get_logger

log = get_logger("shared.registration")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def discover_host(directory: GrpcEndpoint | None = None) -> str | None:
    """A non-loopback IPv4 address of this machine, or None. Blocking (DNS); run it in a thread.

    First the reference's way (host name → DNS → first non-loopback IPv4), then the local address
    of the route to `directory` (a UDP "connection": nothing is sent).
    """
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as error:
        log.debug("host name lookup failed", error=str(error))
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not _is_loopback(address):
            return address
    if directory is not None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((directory.host, directory.port))
                address = str(probe.getsockname()[0])
        except OSError as error:
            log.debug("no route to the directory", error=str(error))
        else:
            if not _is_loopback(address) and address != "0.0.0.0":
                return address
    return None
