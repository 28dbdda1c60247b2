"""`cogment-aux`: the one installed command, shaped like the Cogment CLI's so that habits carry over.

    cogment-aux services directory|model_registry|trial_datastore|all [flags]
    cogment-aux client directory|model_registry|trial_datastore COMMAND [flags]
    cogment-aux demo [flags]
    cogment-aux migrate [flags]

Each form runs the `main` of the module that `python -m` runs (the table below), with the words
after the forms' own: same flags, same environment variables, same exit statuses. Modules are
imported only when chosen, so that a client command never loads server code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shared.version import PACKAGE_VERSION

PROG = "cogment-aux"


@dataclass(frozen=True)
class Target:
    """A module whose `main(argv, prog)` a form runs, and the line `--help` gives it."""

    module: str
    help: str


SERVICES: Mapping[str, Target] = {
    "directory": Target("services.directory.__main__", "the Directory (port 9005)"),
    "model_registry": Target("services.model_registry.__main__", "the Model Registry (port 9002)"),
    "trial_datastore": Target("services.datastore.__main__", "the Trial Datastore (port 9003)"),
    "console": Target("services.console.service", "the web console (http://127.0.0.1:9010)"),
    "all": Target("services.__main__", "the three, each in its own process"),
}
CLIENTS: Mapping[str, Target] = {
    "directory": Target("services.directory.client.__main__", "register, inquire, deregister services"),
    "model_registry": Target(
        "services.model_registry.client.__main__", "list, upload, download models' versions"
    ),
    "trial_datastore": Target("services.datastore.client.__main__", "list, export, import, delete trials"),
}
GROUPS: Mapping[str, tuple[str, Mapping[str, Target]]] = {
    "services": ("run a service", SERVICES),
    "client": ("talk to a running service", CLIENTS),
}
COMMANDS: Mapping[str, Target] = {
    "demo": Target("services.demo.cli", "record demo trials, publish a policy's versions, register"),
    "migrate": Target("shared.migrate", "apply the schema migrations to a database, then exit"),
}


def _usage() -> str:
    lines = [f"usage: {PROG} COMMAND ...", "", "Cogment auxiliary services and their clients.", ""]
    for group, (help_text, targets) in GROUPS.items():
        lines.append(f"  {group} {{{','.join(targets)}}} ...")
        lines.append(f"      {help_text}:")
        lines.extend(f"        {name:<17}{target.help}" for name, target in targets.items())
    for name, target in COMMANDS.items():
        lines.append(f"  {name} [flags]")
        lines.append(f"      {target.help}")
    lines += ["", f"`{PROG} COMMAND ... --help` describes each one. Version {PACKAGE_VERSION}."]
    return "\n".join(lines)


def _run(target: Target, argv: Sequence[str], prog: str) -> int:
    main: Callable[..., int] = importlib.import_module(target.module).main
    return main(list(argv), prog=prog)


def _fail(message: str) -> int:
    print(f"{_usage()}\n\n{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if not words:
        return _fail("a command is needed")
    if words[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if words[0] == "--version":
        print(f"{PROG} {PACKAGE_VERSION}")
        return 0
    command, rest = words[0], words[1:]
    if command in COMMANDS:
        return _run(COMMANDS[command], rest, f"{PROG} {command}")
    if command not in GROUPS:
        return _fail(f"unknown command {command!r}: choose from {', '.join([*GROUPS, *COMMANDS])}")
    _, targets = GROUPS[command]
    if rest and rest[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not rest or rest[0] not in targets:
        given = f"unknown {command} {rest[0]!r}" if rest else f"{command} needs a name"
        return _fail(f"{given}: choose from {', '.join(targets)}")
    return _run(targets[rest[0]], rest[1:], f"{PROG} {command} {rest[0]}")


if __name__ == "__main__":
    sys.exit(main())
