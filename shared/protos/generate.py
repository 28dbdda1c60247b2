"""Generate the Python protobuf code in `shared/api/` from `shared/protos/cogment/api/*.proto`, and
that of the project's other protos (`PROTO_SETS`) beside them.

Usage: `python -m shared.protos.generate` to (re)write the generated files, or
`python -m shared.protos.generate --check` to fail when the committed files drift from the protos.

The protos keep the reference's file names under `cogment/api/` (they are part of the wire
identity seen through reflection); the generated modules live in the `shared.api` package, so
their cross-imports are rewritten from `cogment.api` to `shared.api`.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc_tools

PROTO_ROOT = Path(__file__).resolve().parent
PROJECT_ROOT = PROTO_ROOT.parent.parent
IMPORT_PATTERN = re.compile(r"\bcogment\.api\b")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


@dataclass(frozen=True)
class ProtoSet:
    """The protos of one folder, and the package folder their modules are written into (imports of
    `cogment.api` rewritten to `shared.api`)."""

    root: Path  # the include root the files are named from
    folder: str  # where the protos are, under `root`
    output: Path
    # The Python package of `output`, when the set's modules import each other (a service's
    # `_grpc` module imports its messages): protoc names them after `folder`, a package that does
    # not exist, and those imports are rewritten to this one.
    package: str | None = None

    @property
    def protos(self) -> list[Path]:
        return sorted((self.root / self.folder).glob("*.proto"))

    def rewrite_own_imports(self, text: str) -> str:
        if self.package is None:
            return text
        # Only module names (`from <folder> import x_pb2`, `<folder>.x_pb2`): the same dotted name
        # also starts the set's proto names (method paths, the serialized descriptors).
        dotted = re.escape(self.folder.replace("/", "."))
        return re.sub(rf"\b{dotted}(?=\.\w+_pb2\b| import )", self.package, text)


PROTO_SETS = [
    # The Cogment API, under the reference's file names.
    ProtoSet(PROTO_ROOT, "cogment/api", PROTO_ROOT.parent / "api"),
    # The project's own services (package `cogment_aux.api`), generated beside the Cogment API's
    # modules they import.
    ProtoSet(PROTO_ROOT, "cogment_aux/api", PROTO_ROOT.parent / "api", package="shared.api"),
    # The messages of the demo's trials (`cogment-aux demo`), which training code decodes.
    ProtoSet(
        PROJECT_ROOT / "services/demo/protos",
        "cogment_aux_demo",
        PROJECT_ROOT / "services/demo/api",
        package="services.demo.api",
    ),
]


def _plugin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    found = candidate if candidate.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install the dev dependencies (mypy-protobuf)")
    return str(found)


def generate_into(proto_set: ProtoSet, target: Path) -> None:
    """Run protoc over the set's proto files and write the rewritten modules into `target`."""
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw_dir:
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_set.root}",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            f"--mypy_out=quiet:{raw_dir}",
            f"--mypy_grpc_out=quiet:{raw_dir}",
            *(str(proto.relative_to(proto_set.root)) for proto in proto_set.protos),
        ]
        subprocess.run(command, check=True)
        target.mkdir(parents=True, exist_ok=True)
        for produced in sorted((Path(raw_dir) / proto_set.folder).iterdir()):
            if produced.name.endswith(GENERATED_SUFFIXES):
                text = proto_set.rewrite_own_imports(IMPORT_PATTERN.sub("shared.api", produced.read_text()))
                (target / produced.name).write_text(text)


def _by_output() -> dict[Path, list[ProtoSet]]:
    """The sets writing into each output folder."""
    outputs: dict[Path, list[ProtoSet]] = {}
    for proto_set in PROTO_SETS:
        outputs.setdefault(proto_set.output, []).append(proto_set)
    return outputs


def _generated_files(directory: Path) -> list[str]:
    """Every generated module in `directory`, those of protos since removed included."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def check() -> int:
    drifted: list[str] = []
    for output, proto_sets in _by_output().items():
        with tempfile.TemporaryDirectory() as fresh_dir:
            fresh = Path(fresh_dir)
            for proto_set in proto_sets:
                generate_into(proto_set, fresh)
            expected, committed = _generated_files(fresh), _generated_files(output)
            where = output.relative_to(PROJECT_ROOT)
            drifted += [f"{where}/{name}" for name in sorted(set(expected) ^ set(committed))]
            drifted += [
                f"{where}/{name}"
                for name in expected
                if name in committed and not filecmp.cmp(fresh / name, output / name, shallow=False)
            ]
    if drifted:
        print("generated protobuf code is out of date: " + ", ".join(drifted), file=sys.stderr)
        print("run `python -m shared.protos.generate` and commit the result", file=sys.stderr)
        return 1
    print("generated protobuf code is up to date")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the generated code drifted")
    if parser.parse_args().check:
        return check()
    for output, proto_sets in _by_output().items():
        for stale in _generated_files(output):
            (output / stale).unlink()
        for proto_set in proto_sets:
            generate_into(proto_set, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
