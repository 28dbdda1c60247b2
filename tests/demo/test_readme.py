"""The README's training example, as it stands in README.md (read from it, so that the two cannot
drift apart), runs on what `cogment-aux demo` recorded into a real datastore and the export its
summary suggests wrote: a fresh interpreter runs it as copied, in the directory the export wrote
`demo-dataset` into."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from tests.demo.helpers import Suite, run_command, run_demo
from tests.helpers.services import PROJECT_ROOT

SECTION = "### Trials as training data"
TICKS, TRIALS, PLAYERS = 30, 3, 3
# Appended to the example: what it computed is the demo's trials, decoded.
CHECKS = f"""
transitions = {TRIALS} * {PLAYERS} * ({TICKS} - 1)
assert arrays["observations"].shape == (transitions, 5), arrays["observations"].shape
assert arrays["observations"].dtype == np.float32
assert set(arrays["actions"].tolist()) <= {{0, 1, 2, 3, 4}}
assert arrays["terminals"].sum() == {TRIALS} * {PLAYERS} and not arrays["timeouts"].any()
assert (arrays["next_observations"][:-1, 4] > arrays["observations"][:-1, 4]).any()
# The last of the batches the loop went through: the transitions left after full ones.
assert batch["frames"].shape == (transitions % 256, 4, 5), batch["frames"].shape
assert batch["frames_valid"].shape == (transitions % 256, 4)
print("training example ran")
"""


def training_example() -> str:
    """The first Python block of the README's "Trials as training data"."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme[readme.index(SECTION) :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"no Python block under {SECTION!r}"
    return match.group(1)


async def test_the_readme_training_example_runs_on_the_demos_trials(suite: Suite, tmp_path: Path) -> None:
    example = training_example()
    assert "services.demo.api.spec_pb2" in example and '"demo-dataset"' in example

    skipped = ["--model_registry_endpoint", "", "--directory_endpoint", ""]
    flags = ["--trials", str(TRIALS), "--ticks", str(TICKS), "--actors", str(PLAYERS), *skipped]
    report = (await run_demo(suite, *flags)).report
    _listing, export = report["next_commands"]
    # The export the demo suggests, as printed (its program run as `python -m` of its module).
    program, *words = shlex.split(export)
    assert (program, words[:3]) == ("cogment-aux", ["client", "trial_datastore", "export"])
    exported = await run_command(
        [sys.executable, "-m", "services.datastore.client", *words[2:]], cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "demo-dataset" / "steps.parquet").exists()

    script = tmp_path / "training_example.py"
    script.write_text(example + CHECKS)
    ran = await run_command([sys.executable, str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.endswith("training example ran\n")
