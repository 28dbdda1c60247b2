"""Command-line flags backed by environment variables, with the reference's names.

Each option has a flag (`--port`), an optional environment variable (`COGMENT_DIRECTORY_PORT`)
and a default. Precedence: flag, then environment variable, then default. Environment variables
may be set to an empty string, which counts as a value (as in the reference).
"""

from __future__ import annotations

import argparse
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T", int, float)
TRUE_WORDS = {"1", "true", "yes", "on", "t", "y"}
FALSE_WORDS = {"0", "false", "no", "off", "f", "n", ""}


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def _bounded(
    name: str, parse: Callable[[str], T], low: T, high: T | None, expected: str
) -> Callable[[str], T]:
    """A parser of `parse`d values within [low, high] (`high` None: no upper bound), called
    `name` (argparse says "invalid <name> value" for text that does not parse)."""

    def parse_bounded(text: str) -> T:
        value = parse(text)
        # Written so that NaN, which compares false with everything, is refused too.
        if not low <= value or (high is not None and not value <= high):  # type: ignore[operator]
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse_bounded.__name__ = name
    return parse_bounded


non_negative_int = _bounded("non_negative_int", int, 0, None, "a non-negative integer")
positive_int = _bounded("positive_int", int, 1, None, "a positive integer")
port_number = _bounded("port_number", int, 0, 65535, "a port number 0..65535")
# Positive: the smallest float above zero.
positive_float = _bounded("positive_float", float, math.ulp(0.0), None, "a positive number")
non_negative_float = _bounded("non_negative_float", float, 0.0, None, "a non-negative number")
up_to_a_second = _bounded("up_to_a_second", float, 0.0, 1.0, "a number of seconds from 0 to 1")


@dataclass(frozen=True)
class Option:
    """One configuration value: `--flag`, its environment variable and its default."""

    flag: str
    help: str
    default: Any = None
    env: str | None = None
    parse: Callable[[str], Any] = str
    choices: Sequence[str] | None = None
    aliases: Sequence[str] = ()
    metavar: str | None = None  # what `--help` calls the value (default: the flag in capitals)

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool


# How `--help` names an option's environment variable, on a line of its own.
_ENV_LINE = "[env "


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, with the description and epilog kept as written (examples), and help
    texts wrapped between words only, each of their lines on its own: an option's environment
    variable gets a line of its own (`add_options`), and a name longer than the column
    (`COGMENT_MODEL_REGISTRY_SENT_MODEL_VERSION_DATA_CHUNK_SIZE`) overflows it rather than being
    cut in two, which could then not be copied. Flags keep their hyphens whole for the same reason."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        for line in text.splitlines():
            line = " ".join(line.split())
            if line.startswith(_ENV_LINE):
                lines.append(line)  # whole, even past the column: it is one name
            else:
                lines += textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False)
        return lines


def build_parser(
    options: Sequence[Option], *, prog: str, description: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """The parser of `options`, with the project's help layout (`HelpFormatter`)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter
    )
    add_options(parser, options)
    return parser


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    for option in options:
        names = [f"--{option.flag}", *(f"--{alias}" for alias in option.aliases)]
        where = f"\n{_ENV_LINE}{option.env}]" if option.env else ""  # its own line: see HelpFormatter
        default = "" if option.default in (None, "") else f" (default: {option.default})"
        kwargs: dict[str, Any] = {
            "dest": option.flag,
            "default": argparse.SUPPRESS,
            "help": f"{option.help}{default}{where}",
            "type": option.parse,
        }
        if option.is_bool:
            # `--flag` alone means true; `--flag=false` is accepted too.
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        if option.choices:
            kwargs["choices"] = option.choices
        if option.metavar:
            kwargs["metavar"] = option.metavar
        parser.add_argument(*names, **kwargs)


def resolve(
    parser: argparse.ArgumentParser,
    options: Sequence[Option],
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Values of `options`: from the parsed flags, else the environment, else the defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for option in options:
        if hasattr(args, option.flag):
            values[option.flag] = getattr(args, option.flag)
        elif option.env is not None and option.env in environ:
            raw = environ[option.env]
            try:
                value = option.parse(raw)
            except (ValueError, argparse.ArgumentTypeError) as error:
                parser.error(f"invalid value for {option.env}: {error}")
            if option.choices and value not in option.choices:
                parser.error(
                    f"invalid value for {option.env}: {raw!r} (choose from {', '.join(option.choices)})"
                )
            values[option.flag] = value
        else:
            values[option.flag] = option.default
    return values


def parse_options(
    options: Sequence[Option],
    argv: Sequence[str] | None = None,
    *,
    prog: str,
    description: str,
    epilog: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    parser = build_parser(options, prog=prog, description=description, epilog=epilog)
    return resolve(parser, options, parser.parse_args(argv), environ)
