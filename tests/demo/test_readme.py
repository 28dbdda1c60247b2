"""The README's training examples, as they stand in README.md (read from it, so that the two
cannot drift apart), run on what `cogment-aux demo` records into a real datastore:

* "Trials as training data": on the export its summary suggests, run by a fresh interpreter as
  copied, in the directory the export wrote `demo-dataset` into;
* "Live replay": the train loop, its endpoint only replaced by the test's, follows the trials of
  the demo command its text says to run in a second terminal, run (as a subprocess) once the loop
  follows, and samples the batches it says it does from them.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.datastore.client.replay_buffer import ReplayBuffer
from services.demo.api.spec_pb2 import Action, Move, Observation
from shared.api import common_pb2, datalog_pb2
from shared.api import environment_pb2 as env
from tests.demo.helpers import Suite, python_module, run_command, run_demo
from tests.helpers.datastore import run_datalog
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


LIVE_SECTION = "#### Live replay: a buffer fed by running trials"
# The quick start's datastore, which the example follows: the test's replaces it.
DATASTORE_ENDPOINT = "grpc://localhost:9003"
# What no demo observation has (each value is in [-1, 1]): a trial without the demo's
# properties, which the example must not follow, observes it.
DECOY_VALUE = 9.0


def live_replay_example() -> tuple[str, list[str]]:
    """The Python block of "Live replay", and the flags of the demo command its text says to run
    beside it (`cogment-aux demo ...`, in a code span before the block)."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme[readme.index(LIVE_SECTION) :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"no Python block under {LIVE_SECTION!r}"
    demo = re.search(r"`cogment-aux demo ([^`]*)`", section[: match.start()])
    assert demo is not None, f"no `cogment-aux demo ...` before the block of {LIVE_SECTION!r}"
    return match.group(1), shlex.split(demo.group(1))


def decoy_samples(ticks: int) -> list[datalog_pb2.DatalogSample]:
    """A player's trial, observing DECOY_VALUE."""
    observation = Observation(values=[DECOY_VALUE] * 5).SerializeToString()
    action = Action(move=Move.UP).SerializeToString()
    return [
        datalog_pb2.DatalogSample(
            info=datalog_pb2.SampleInfo(
                tick_id=tick,
                timestamp=1000 + tick,
                state=common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING,
            ),
            observations=env.ObservationSet(observations=[observation], actors_map=[0]),
            actions=[common_pb2.Action(content=action)],
        )
        for tick in range(ticks)
    ]


async def test_the_readme_live_replay_example_samples_the_demos_trials_as_they_run(
    suite: Suite, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example, demo_flags = live_replay_example()
    assert example.count(DATASTORE_ENDPOINT) == 1, f"the example follows {DATASTORE_ENDPOINT} once"
    loop_batches = re.search(r"for _ in range\((\d+)\):", example)
    batch_size = re.search(r"buffer\.sample\((\d+)", example)
    assert loop_batches and batch_size, "the example's loop: `for _ in range(N):`, `buffer.sample(SIZE`"
    batches, size = int(loop_batches.group(1)), int(batch_size.group(1))
    source = example.replace(DATASTORE_ENDPOINT, suite.datastore_endpoint)

    # What the example's buffer does, seen from here: when it follows, what it samples, and the
    # trials of the steps it is fed (its feed's thread calls `extend`, one episode per actor).
    followed: list[ReplayBuffer] = []
    sampled: list[dict[str, Any]] = []
    fed_trials: set[str] = set()
    from_datastore, sample, extend = ReplayBuffer.from_datastore, ReplayBuffer.sample, ReplayBuffer.extend

    def following(*args: Any, **kwargs: Any) -> ReplayBuffer:
        buffer = from_datastore(*args, **kwargs)
        followed.append(buffer)
        return buffer

    def sampling(self: ReplayBuffer, *args: Any, **kwargs: Any) -> dict[str, Any]:
        batch = sample(self, *args, **kwargs)
        sampled.append(batch)
        return batch

    def fed(self: ReplayBuffer, episode: tuple[str, int], *args: Any, **kwargs: Any) -> None:
        fed_trials.add(episode[0])
        extend(self, episode, *args, **kwargs)

    monkeypatch.setattr(ReplayBuffer, "from_datastore", following)
    monkeypatch.setattr(ReplayBuffer, "sample", sampling)
    monkeypatch.setattr(ReplayBuffer, "extend", fed)

    started = time.monotonic()
    code = compile(source, "<README.md: live replay>", "exec")
    ran = asyncio.ensure_future(asyncio.to_thread(exec, code, {"__name__": "__main__"}))
    try:
        while not followed:  # the loop is started first, as the README says
            assert not ran.done(), ran.exception()
            await asyncio.sleep(0.01)
        # Then, beside it, a trial of players without the demo's properties, and the demo.
        decoy = common_pb2.TrialParams(
            actors=[common_pb2.ActorParams(name="p", actor_class="player", implementation="decoy")],
            properties={"demo": "not-cogment-aux"},
        )
        assert await run_datalog(suite.datastore, "decoy", decoy_samples(50), decoy) == 1 + 50
        demo = await run_command(
            python_module("services.demo", *suite.endpoint_flags(), "--console_output", "json", *demo_flags)
        )
        assert demo.returncode == 0, demo.stderr
        await asyncio.wait_for(asyncio.shield(ran), 60)
        took = time.monotonic() - started
    finally:
        if not ran.done():  # a failure here: its `sample` raises once its buffer is closed
            for buffer in followed:
                buffer.close()
        await asyncio.gather(ran, return_exceptions=True)

    report = json.loads(demo.stdout)
    demo_trials = set(report["trials"]["trial_ids"])
    assert report["trials"]["properties"] == {"demo": "cogment-aux", "run": report["run_id"]}
    assert fed_trials and fed_trials <= demo_trials, sorted(fed_trials - demo_trials)
    assert len(sampled) == batches
    for batch in sampled:
        assert batch["observations"].shape == batch["next_observations"].shape == (size, 5)
        assert np.abs(batch["observations"]).max() <= 1.0  # the demo's, none of the decoy's
        assert set(batch["actions"].tolist()) <= set(Move.values())
        assert (batch["weights"] > 0).all() and (batch["weights"] <= 1).all()
    assert re.search(rf"^{batches} batches sampled", capsys.readouterr().out, re.MULTILINE)
    assert took < 45, f"the example took {took:.1f} s"
