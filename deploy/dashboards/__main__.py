"""`python -m deploy.dashboards [--check]`: write the dashboards' JSON into the chart, or check
that it is current."""

from __future__ import annotations

import argparse
import sys

from deploy.dashboards import OUTPUT_DIR, rendered


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.dashboards", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the files differ from the code")
    args = parser.parse_args()
    files = rendered()
    stale = sorted(
        path.name
        for path in {*files, *OUTPUT_DIR.glob("*.json")}
        if not path.exists() or path.read_text() != files.get(path)
    )
    if args.check:
        if stale:
            print(
                f"dashboards out of date in {OUTPUT_DIR}: {', '.join(stale)}; run `make generate`",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT_DIR.mkdir(exist_ok=True)
    for path in OUTPUT_DIR.glob("*.json"):
        if path not in files:
            path.unlink()
    for path, text in files.items():
        path.write_text(text)
    print(f"wrote {len(files)} dashboards to {OUTPUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
