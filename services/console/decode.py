"""How the sample inspector shows observations, actions and messages: decoded into readable
fields when the console was given the trial's compiled protobuf messages (`--proto_module`,
`--messages`), else their size and first bytes in hex."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from google.protobuf import descriptor_pool, message_factory, text_format
from google.protobuf.message import DecodeError, Message

from services.console.model import Payload

PREVIEW_BYTES = 32
# Characters of a decoded message shown at most.
DECODED_CHARS = 4000
KINDS = ("observation", "action")


class DecoderError(ValueError):
    """A --proto_module or --messages value that cannot be used; the message says why."""


def preview(data: bytes) -> str:
    return data[:PREVIEW_BYTES].hex(" ") + (" …" if len(data) > PREVIEW_BYTES else "")


@dataclass(frozen=True)
class Decoders:
    """Message classes by (actor class, "observation" or "action")."""

    classes: dict[tuple[str, str], type[Message]] = field(default_factory=dict)

    @classmethod
    def load(cls, modules: list[str], messages: list[str]) -> Decoders:
        """`modules`: Python modules of compiled protos, imported so their messages are known;
        `messages`: `CLASS=OBSERVATION_MESSAGE,ACTION_MESSAGE` (full names; either may be empty)."""
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise DecoderError(f"cannot import --proto_module [{module}]: {error}") from None
        pool = descriptor_pool.Default()
        classes: dict[tuple[str, str], type[Message]] = {}
        for spec in messages:
            actor_class, _, names = spec.partition("=")
            parts = names.split(",")
            if not actor_class or not names or len(parts) != 2:
                raise DecoderError(
                    f"invalid --messages [{spec}]: expected CLASS=OBSERVATION_MESSAGE,ACTION_MESSAGE"
                )
            for kind, name in zip(KINDS, parts, strict=True):
                if not name:
                    continue
                try:
                    descriptor = pool.FindMessageTypeByName(name)
                except KeyError:
                    raise DecoderError(
                        f"--messages [{spec}]: no message [{name}] "
                        "(give the module defining it with --proto_module)"
                    ) from None
                classes[(actor_class, kind)] = message_factory.GetMessageClass(descriptor)
        return cls(classes)

    def payload(self, data: bytes, actor_class: str, kind: str) -> Payload:
        message_class = self.classes.get((actor_class, kind))
        decoded = ""
        if message_class is not None:
            message = message_class()
            try:
                message.ParseFromString(data)
                decoded = text_format.MessageToString(message, as_one_line=True)[:DECODED_CHARS] or "(empty)"
            except DecodeError:
                decoded = f"(not a {message_class.DESCRIPTOR.full_name})"
        return Payload(len(data), preview(data), decoded)
