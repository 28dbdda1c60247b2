"""What the command-line clients share: option parsers, the TLS flags, JSON output, progress
bars, and the program around their commands (flags into a command, the connection, errors into
exit codes), so that each client's `cli` module holds only its own commands. The connection
itself, which the Python APIs use too, is `shared.client`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Generic, TextIO, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError, ServiceClient
from shared.config import HelpFormatter, Option, add_options, parse_bool, resolve
from shared.endpoints import GrpcEndpoint, parse_grpc_endpoint, parse_properties

STDIO = "-"  # as a file name: standard input or output
PROGRESS_INTERVAL_S = 0.1
PROGRESS_BAR_WIDTH = 30

T = TypeVar("T")

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

Values = Mapping[str, Any]
# Reports invalid usage: argparse's `error`, which exits with code 2.
Usage = Callable[[str], Any]


# ---- option value parsers ----


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


# ---- options every client has, or several ----


def timeout_option(help_text: str) -> Option:
    """`--timeout`; its help says what it bounds, which differs between clients."""
    return Option("timeout", help_text, DEFAULT_TIMEOUT_S, "COGMENT_CLIENT_TIMEOUT", parse_duration)


CONSOLE_OUTPUT_OPTION = Option(
    "console_output",
    "console output format",
    "text",
    "COGMENT_CLIENT_CONSOLE_OUTPUT",
    str.lower,
    choices=["text", "json"],
)
# The client's TLS, as the services name theirs (`--tls_cert`...), under COGMENT_CLIENT_ variables: a
# service's own COGMENT_<SERVICE>_TLS_CERT is its server certificate, often set in the same shell.
TLS_OPTIONS = [
    Option(
        "tls_ca",
        "PEM CA bundle the server's certificate is checked against: connect over TLS (a grpcs:// "
        "endpoint without it: TLS checked against the system's CAs)",
        "",
        "COGMENT_CLIENT_TLS_CA",
    ),
    Option(
        "tls_cert",
        "PEM client certificate, for a server that requires one (mTLS); with --tls_key",
        "",
        "COGMENT_CLIENT_TLS_CERT",
    ),
    Option("tls_key", "PEM private key of --tls_cert", "", "COGMENT_CLIENT_TLS_KEY"),
]
PROGRESS_OPTION = Option(
    "progress",
    "show a progress bar on standard error (default: for large transfers when it is a terminal)",
    None,
    parse=parse_bool,
)


def tls_of(values: Values) -> ClientTls | None:
    """The TLS the flags ask for: none when no TLS flag is set (a grpcs:// endpoint still is)."""
    if not (values["tls_ca"] or values["tls_cert"] or values["tls_key"]):
        return None
    return ClientTls(values["tls_ca"], values["tls_cert"], values["tls_key"])


def check_tls(values: Values, usage: Usage) -> None:
    if bool(values["tls_cert"]) != bool(values["tls_key"]):
        usage("--tls_cert and --tls_key go together: a client certificate needs its key")


# ---- output ----


def to_json(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def binary_stream(stream: IO[str], what: str) -> BinaryIO:
    """The bytes under a text stream (`what` names it in the error when it has none)."""
    binary: BinaryIO | None = getattr(stream, "buffer", None)
    if binary is None:
        raise ClientError(f"{what} does not accept binary data")
    return binary


def mib(count: float) -> str:
    return f"{count / (1024 * 1024):.1f}"


@dataclass(frozen=True)
class ProgressUnit:
    """What a progress bar counts: how its amounts read, and from which total a bar shows by itself."""

    # (done, total, done per second) → the amounts after the percentage.
    amounts: Callable[[int, int, float], str]
    automatic_min: int


# Automatic byte bars only from two of the registry's 2 MiB upload chunks: smaller transfers end
# before a bar would tell anything.
BYTES = ProgressUnit(
    lambda done, total, rate: f"{mib(done)}/{mib(total)} MiB {mib(rate)} MiB/s", 4 * 1024 * 1024
)


class Progress:
    """A one-line progress bar rewritten in place (carriage return, no terminal control codes);
    drawn on `stream`, or nowhere when it is None."""

    def __init__(self, label: str, total: int, stream: TextIO | None, unit: ProgressUnit) -> None:
        self._label = label
        self._total = total
        self._stream = stream
        self._unit = unit
        self._done = 0
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._width = 0

    def advance(self, count: int) -> None:
        self._done += count
        now = time.monotonic()
        if now - self._last_draw >= PROGRESS_INTERVAL_S:
            self._draw(now)

    def close(self, completed: bool) -> None:
        """End the bar's line (drawn full if `completed`); later calls do nothing."""
        if self._stream is None:
            return
        if completed:
            self._draw(time.monotonic())
        if self._width:
            self._stream.write("\n")
            self._stream.flush()
        self._stream = None

    def _draw(self, now: float) -> None:
        if self._stream is None:
            return
        self._last_draw = now
        fraction = min(self._done / self._total, 1.0) if self._total else 1.0
        filled = int(fraction * PROGRESS_BAR_WIDTH)
        bar = "#" * filled + "." * (PROGRESS_BAR_WIDTH - filled)
        amounts = self._unit.amounts(self._done, self._total, self._done / max(now - self._started, 1e-6))
        line = f"{self._label} [{bar}] {fraction * 100:5.1f}% {amounts}"
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)


def make_progress(label: str, total: int, unit: ProgressUnit, values: Values, err: TextIO) -> Progress:
    """The bar `--progress` asks for; without it, one for large transfers when `err` is a terminal."""
    wanted = values["progress"]
    if wanted is None:
        wanted = total >= unit.automatic_min and err.isatty()
    return Progress(label, total, err if wanted else None, unit)


def _discard_standard_output(out: TextIO) -> None:
    """Point standard output, when `out` is it, at /dev/null: Python flushes it at exit, which
    would fail (and print a traceback) on the closed pipe again."""
    if out is sys.stdout:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def run_to_exit_status(run: Callable[[], Coroutine[Any, Any, None]], out: TextIO, err: TextIO) -> int:
    """Run the coroutine `run` makes, then flush `out`; the program's exit status: 0, 1 on a
    ClientError (printed on `err` as one line, `Error: ...`), 130 when interrupted, 141 when the
    reader of `out` went away (`| head`)."""
    try:
        asyncio.run(run())
        out.flush()  # here, where a closed output is handled, not at exit
    except ClientError as error:
        print(f"Error: {error}", file=err)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Stop quietly, with the status of a program that SIGPIPE ended.
        _discard_standard_output(out)
        return 128 + signal.SIGPIPE
    return 0


def tls_flags(client: ServiceClient) -> list[str]:
    """The TLS flags (`--tls_ca`, `--tls_cert`, `--tls_key`) of the TLS `client` connects with,
    for a command that reaches the same service; none for plaintext or the system's CAs alone."""
    if client.tls is None:
        return []
    paths = (("tls_ca", client.tls.ca), ("tls_cert", client.tls.cert), ("tls_key", client.tls.key))
    return [word for name, path in paths if path for word in (f"--{name}", path)]


C = TypeVar("C", bound=ServiceClient)


# ---- commands ----


@dataclass(frozen=True)
class Context(Generic[C]):
    """What a command runs with."""

    client: C
    values: Values  # flags and positional arguments, by name
    out: TextIO
    err: TextIO

    @property
    def json(self) -> bool:
        return bool(self.values["console_output"] == "json")


@dataclass(frozen=True)
class Positional:
    """A positional argument of a command (argparse's `add_argument` parameters)."""

    name: str
    help: str
    parse: Callable[[str], Any] = str
    nargs: str | None = None
    metavar: str | None = None


def _no_check(values: Values, usage: Usage) -> None:
    pass


@dataclass(frozen=True)
class Command(Generic[C]):
    name: str
    help: str
    run: Callable[[Context[C]], Awaitable[None]]
    options: Sequence[Option] = ()
    positionals: Sequence[Positional] = ()
    aliases: tuple[str, ...] = ()
    # Checks the values before connecting; calls `usage` (exit code 2) on errors.
    check: Callable[[Values, Usage], None] = _no_check
    # Adds arguments that are not options (nor positionals) to the command's parser.
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


@dataclass(frozen=True)
class ClientProgram(Generic[C]):
    """A command-line client: its flags, its commands, and how it connects to its service.

    `main` exits with 0 on success, 1 on failure (a ClientError, or a gRPC error described by the
    client), 2 on invalid usage, 130 when interrupted and 141 when its output is closed early."""

    prog: str
    description: str
    options: Sequence[Option]  # the flags of every command, besides the TLS flags every client has
    commands: Sequence[Command[C]]
    # The client of the flags' endpoint and TLS (`tls_of(values)`).
    connect: Callable[[Values], C]

    @property
    def common_options(self) -> list[Option]:
        return [*self.options, *TLS_OPTIONS]

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=prog or self.prog,
            description=self.description,
            formatter_class=HelpFormatter,
            epilog=(
                "Exit codes: 0 success, 1 failure, 2 invalid usage, 130 interrupted, 141 output "
                "closed before everything was written (e.g. by `| head`)."
            ),
        )
        add_options(parser, self.common_options)
        commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
        for command in self.commands:
            subparser = commands.add_parser(
                command.name,
                aliases=list(command.aliases),
                help=command.help,
                description=command.help,
                formatter_class=HelpFormatter,
            )
            for positional in command.positionals:
                subparser.add_argument(
                    positional.name,
                    help=positional.help,
                    type=positional.parse,
                    nargs=positional.nargs,
                    metavar=positional.metavar,
                )
            add_options(subparser, [*self.common_options, *command.options])
            if command.add_arguments is not None:
                command.add_arguments(subparser)
            subparser.set_defaults(command_spec=command, command_parser=subparser)
        return parser

    def main(
        self,
        argv: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        prog: str | None = None,
    ) -> int:
        """Run the command of `argv` (`prog`: how `--help` names the program, default `self.prog`)."""
        out = out or sys.stdout
        err = err or sys.stderr
        words = self._attach_dashed_values(sys.argv[1:] if argv is None else argv)
        args = self.build_parser(prog).parse_args(words)
        command: Command[C] = args.command_spec
        subparser: argparse.ArgumentParser = args.command_parser
        values = resolve(subparser, [*self.common_options, *command.options], args, environ)
        values.update({positional.name: getattr(args, positional.name) for positional in command.positionals})
        check_tls(values, subparser.error)
        command.check(values, subparser.error)
        return run_to_exit_status(functools.partial(self._execute, command, values, out, err), out, err)

    def _attach_dashed_values(self, argv: Sequence[str]) -> list[str]:
        """`--flag -value` as `--flag=-value` for the text flags: argparse takes a word that
        begins with '-' for a flag, but a value may (a registration's secret is base64url, one
        in 64 begins with '-'). A word that is itself a flag is left alone."""
        options = [*self.common_options, *(option for command in self.commands for option in command.options)]
        names = {f"--{name}" for option in options for name in (option.flag, *option.aliases)}
        flags = names | {"-h", "--help"}
        text_flags = {
            f"--{name}"
            for option in options
            if option.parse is str and not option.choices
            for name in (option.flag, *option.aliases)
        }
        words: list[str] = []
        index = 0
        while index < len(argv):
            word = argv[index]
            following = argv[index + 1] if index + 1 < len(argv) else None
            if (
                word in text_flags
                and following is not None
                and following.startswith("-")
                and following.split("=", 1)[0] not in flags
            ):
                words.append(f"{word}={following}")
                index += 2
                continue
            words.append(word)
            index += 1
        return words

    async def _execute(self, command: Command[C], values: Values, out: TextIO, err: TextIO) -> None:
        client = self.connect(values)
        try:
            await command.run(Context(client, values, out, err))
        except grpc.aio.AioRpcError as error:
            raise ClientError(client.describe_rpc_error(error, command.name)) from None
        finally:
            await client.close()
