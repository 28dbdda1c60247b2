"""The PyTorch adapter: a DataLoader gives the batches `sample` gives, as tensors; keys go back
to `update_priorities`; worker processes and undecoded columns fail clearly; and the package
imports without torch."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch.utils.data import DataLoader

from services.datastore.client.replay_buffer import ReplayBuffer
from services.datastore.client.torch_batches import torch_batches
from tests.helpers.services import PROJECT_ROOT

VIEWS = {"frames": ("observation", "-2:0"), "next_action": ("action", 1)}


def filled(steps: int = 20, **options: Any) -> ReplayBuffer:
    """Two finished episodes of `steps` decoded steps: float observations, int actions."""
    buffer = ReplayBuffer(1000, **options)
    for episode in range(2):
        buffer.extend(
            episode,
            [np.array([episode, position], np.float32) for position in range(steps)],
            [np.int64(episode * 100 + position) for position in range(steps)],
            [float(position) for position in range(steps)],
        )
        buffer.finish(episode, ended=episode == 0)
    return buffer


def test_a_dataloader_gives_the_batches_sample_gives() -> None:
    options: dict[str, Any] = {"seed": 3, "n_step": 3, "views": VIEWS}
    expected_buffer = filled(**options)
    expected = [expected_buffer.sample(8) for _ in range(4)]
    loader = DataLoader(torch_batches(filled(**options), 8, batches=4), batch_size=None)
    got = list(loader)
    assert len(got) == 4
    for batch, arrays in zip(got, expected, strict=True):
        assert batch.keys() == arrays.keys()
        for name, array in arrays.items():
            tensor = batch[name]
            assert isinstance(tensor, torch.Tensor), name
            assert tensor.dtype == torch.from_numpy(array[:0]).dtype, name
            assert tuple(tensor.shape) == array.shape, name
            assert np.array_equal(tensor.numpy(), array), name
    assert got[0]["keys"].dtype == torch.int64


def test_tensors_share_the_sampled_arrays_memory() -> None:
    buffer = filled(seed=0)
    sampled: list[dict[str, npt.NDArray[Any]]] = []
    sample = buffer.sample

    def kept(batch_size: int, timeout_s: float | None = None) -> dict[str, npt.NDArray[Any]]:
        sampled.append(sample(batch_size, timeout_s))
        return sampled[-1]

    buffer.sample = kept  # type: ignore[method-assign]
    batch = next(iter(torch_batches(buffer, 4)))
    for name, array in sampled[0].items():
        assert np.shares_memory(batch[name].numpy(), array), name


def test_a_device_takes_every_tensor_but_the_keys() -> None:
    # "meta" stands for an accelerator: tensors without data, on any build of torch.
    batch = next(iter(torch_batches(filled(), 4, device="meta")))
    assert batch["keys"].device.type == "cpu"
    assert {tensor.device.type for name, tensor in batch.items() if name != "keys"} == {"meta"}


@pytest.mark.filterwarnings("error::DeprecationWarning")  # numpy's, on np.array(tensor, ndmin=1)
def test_keys_go_back_to_update_priorities() -> None:
    buffer = filled(sampler="prioritized", alpha=1.0, beta=1.0, seed=7)
    loader = DataLoader(torch_batches(buffer, 64, batches=1), batch_size=None)
    keys = next(iter(loader))["keys"]
    favourite = keys[0]
    buffer.update_priorities(keys, torch.where(keys == favourite, 1000.0, 0.01))
    assert np.mean(buffer.sample(1000)["keys"] == int(favourite)) > 0.9


def test_batches_stops_after_that_many_and_none_goes_on() -> None:
    buffer = filled()
    assert len(list(DataLoader(torch_batches(buffer, 2, batches=3), batch_size=None))) == 3
    assert list(torch_batches(buffer, 2, batches=0)) == []
    endless = DataLoader(torch_batches(buffer, 2), batch_size=None)
    assert len(list(itertools.islice(endless, 50))) == 50
    with pytest.raises(ValueError, match="batches must be at least 0"):
        torch_batches(buffer, 2, batches=-1)


def test_the_buffer_s_errors_come_through() -> None:
    buffer = filled(min_size=100)
    with pytest.raises(TimeoutError, match="min_size"):
        next(iter(torch_batches(buffer, 2, timeout_s=0.05)))
    buffer.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(torch_batches(buffer, 2)))


def test_a_forked_worker_fails_clearly() -> None:
    loader = DataLoader(torch_batches(filled(), 2, batches=1), batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match=r"cannot run in DataLoader worker processes.*num_workers=0"):
        list(loader)


@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch's own hint, beside ours
def test_a_spawned_worker_fails_clearly() -> None:
    loader = DataLoader(
        torch_batches(filled(), 2, batches=1),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    with pytest.raises(TypeError, match=r"cannot run in DataLoader worker processes.*num_workers=0"):
        list(loader)


def test_an_undecoded_column_raises_naming_it() -> None:
    buffer = ReplayBuffer(100)
    buffer.extend("e", [np.zeros(2, np.float32)] * 3, [b"raw action"] * 3, [0.0] * 3)
    with pytest.raises(TypeError, match=r"batch column 'actions' holds object values.*decode_action="):
        next(iter(torch_batches(buffer, 2)))


def test_the_package_imports_without_torch() -> None:
    code = """
import sys
sys.modules["torch"] = None  # import torch raises ImportError
from services.datastore.client.replay_buffer import ReplayBuffer
from services.datastore.client.torch_batches import torch_batches
try:
    torch_batches(ReplayBuffer(10), 2)
except ImportError as error:
    print(error)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "torch_batches needs PyTorch" in result.stdout and "pip install torch" in result.stdout
