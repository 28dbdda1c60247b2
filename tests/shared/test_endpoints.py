"""Endpoint URLs, property strings and service type names (`shared.endpoints`)."""

from __future__ import annotations

import re

import pytest

from shared.api import directory_pb2
from shared.endpoints import (
    SERVICE_TYPES,
    GrpcEndpoint,
    format_properties,
    parse_grpc_endpoint,
    parse_properties,
    parse_service_type,
    service_type_name,
)

# ---- grpc:// endpoints ----


@pytest.mark.parametrize(
    ("text", "host", "port", "address"),
    [
        ("grpc://localhost:9005", "localhost", 9005, "localhost:9005"),
        ("grpc://127.0.0.1:1", "127.0.0.1", 1, "127.0.0.1:1"),
        ("  grpc://my-host.example.com:65535/ ", "my-host.example.com", 65535, "my-host.example.com:65535"),
        ("GRPC://dir_1:9005", "dir_1", 9005, "dir_1:9005"),
        ("grpc://[::1]:9005", "::1", 9005, "[::1]:9005"),
        ("grpc://[fe80::1:2]:80", "fe80::1:2", 80, "[fe80::1:2]:80"),
    ],
)
def test_parse_grpc_endpoint(text: str, host: str, port: int, address: str) -> None:
    endpoint = parse_grpc_endpoint(text)
    assert endpoint == GrpcEndpoint(host, port)
    assert endpoint.address == address
    assert str(endpoint) == endpoint.url == f"grpc://{address}"
    assert parse_grpc_endpoint(endpoint.url) == endpoint


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty endpoint"),
        ("   ", "empty endpoint"),
        ("localhost:9005", "no scheme"),
        ("http://localhost:9005", "unexpected scheme [http]"),
        ("cogment://discover/actor", "cogment:// (discovery or client) endpoints cannot be used here"),
        ("grpc://localhost", "missing port"),
        ("grpc://localhost:", "missing port"),
        ("grpc://:9005", "missing host"),
        ("grpc://localhost:abc", "invalid port [abc]"),
        ("grpc://localhost:-1", "invalid port [-1]"),
        ("grpc://localhost:0", "out of range"),
        ("grpc://localhost:65536", "out of range"),
        ("grpc://localhost:9005/path", "unexpected path"),
        ("grpc://localhost:9005?a=b", "unexpected query"),
        ("grpc://localhost:9005#x", "unexpected fragment"),
        ("grpc://user@localhost:9005", "unexpected user information"),
        ("grpc://::1:9005", "an IPv6 host goes in brackets"),
        ("grpc://[::1:9005", "unclosed '['"),
        ("grpc://[::1]", "missing port"),
        ("grpc://[::1]9005", "missing port"),
        ("grpc://[not-ipv6]:9005", "invalid IPv6 address [not-ipv6]"),
        ("grpc://bad host:9005", "invalid host [bad host]"),
    ],
)
def test_parse_grpc_endpoint_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_grpc_endpoint(text)
    assert message in str(caught.value)
    assert "expected grpc://<host>:<port>" in str(caught.value)


# ---- property strings ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("a=1", {"a": "1"}),
        ("a=1,b=2", {"a": "1", "b": "2"}),
        ("  a = 1 ,  b=2  ", {"a": "1", "b": "2"}),
        ("a=1,a=2", {"a": "2"}),  # a later duplicate wins
        ("flag", {"flag": ""}),  # a bare name is an empty value
        ("a=", {"a": ""}),
        ("a=1,,b, ,", {"a": "1", "b": ""}),  # empty segments are skipped
        (",", {}),
        (
            "__actor_class=player,__implementation=random",
            {"__actor_class": "player", "__implementation": "random"},
        ),
    ],
)
def test_parse_properties(text: str, expected: dict[str, str]) -> None:
    assert parse_properties(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a=b=c", "invalid property [a=b=c]: more than one '='"),
        ("x=1,a==b", "invalid property [a==b]: more than one '='"),
        ("=value", "invalid property [=value]: empty name"),
        ("a=1, = ", "invalid property [=]: empty name"),
    ],
)
def test_parse_properties_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^" + re.escape(message)):
        parse_properties(text)


@pytest.mark.parametrize(
    "properties",
    [{}, {"a": "1"}, {"a": "1", "flag": "", "b": "two words"}, {"__version": "1.2.3"}],
)
def test_format_properties_round_trip(properties: dict[str, str]) -> None:
    text = format_properties(properties)
    assert parse_properties(text) == properties


def test_format_properties_text() -> None:
    assert format_properties({"a": "1", "flag": "", "b": "2"}) == "a=1,flag,b=2"


@pytest.mark.parametrize(
    "properties",
    [{"": "x"}, {"a,b": "1"}, {"a": "1,2"}, {"a=b": "1"}, {"a": "x=y"}, {" a": "1"}, {"a": "1 "}],
)
def test_format_properties_refuses_what_cannot_round_trip(properties: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        format_properties(properties)


# ---- service types ----


def test_service_type_names() -> None:
    assert list(SERVICE_TYPES) == [
        "actor",
        "environment",
        "prehook",
        "datalog",
        "lifecycle",
        "actservice",
        "datastore",
        "modelregistry",
        "directory",
        "other",
    ]
    for name, value in SERVICE_TYPES.items():
        assert parse_service_type(name) == value
        assert parse_service_type(name.upper()) == value
        assert service_type_name(value) == name
    assert parse_service_type("actservice") == directory_pb2.CLIENT_ACTOR_CONNECTION_SERVICE
    assert parse_service_type("lifecycle") == directory_pb2.TRIAL_LIFE_CYCLE_SERVICE
    assert parse_service_type("") == directory_pb2.UNKNOWN_SERVICE
    assert service_type_name(directory_pb2.UNKNOWN_SERVICE) == ""
    assert service_type_name(42) == "<unknown 42>"


def test_invalid_service_type() -> None:
    with pytest.raises(ValueError, match=r"invalid service type \[actors\], expected one of actor, "):
        parse_service_type("actors")
