"""What the command-line clients share: option parsers and JSON output."""

from __future__ import annotations

import argparse
import re
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shared.endpoints import GrpcEndpoint, parse_grpc_endpoint, parse_properties

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """Seconds, from a number of seconds (`30`, `2.5`) or a Go duration (`30s`, `1m30s`, `500ms`).
    Must be positive."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        position, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(value):
            if match.start() != position:
                break
            seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            position = match.end()
        if position != len(value) or not value:
            raise argparse.ArgumentTypeError(
                f"invalid duration {text!r}: expected seconds or a duration such as 30s, 1m30s, 500ms"
            ) from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: must be positive")
    return seconds


def endpoint_arg(text: str) -> GrpcEndpoint:
    try:
        return parse_grpc_endpoint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def properties_arg(text: str) -> dict[str, str]:
    try:
        return parse_properties(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def to_json(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
