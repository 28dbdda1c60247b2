"""The replay buffer's batches as a PyTorch `IterableDataset`, for a `DataLoader` with
`batch_size=None` (the buffer batches already). Torch is imported when the dataset is made, not
with this module: the package never needs it.

    loader = DataLoader(torch_batches(buffer, 256, timeout_s=30), batch_size=None)
    for batch in loader:  # observations, ..., keys, weights: tensors
        buffer.update_priorities(batch["keys"], new_priorities)

A batch's tensors share the memory of the arrays `sample` gave (`torch.from_numpy`: no copy),
on the CPU unless `device` names another; `keys` stay int64 on the CPU, for `update_priorities`.
A column of Python objects (bytes no decoder decoded, and the None padding of their views) has no
tensor: it raises `TypeError`, give the buffer decoders. The buffer holds threads and its feed, so
a DataLoader's worker processes would each sample a copy of it, never fed: a forked worker raises
as it iterates, a spawned one as it is given the dataset. Keep `num_workers=0` (the feed already
runs beside the training loop).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from services.datastore.client.replay_buffer import ReplayBuffer

if TYPE_CHECKING:
    import torch
    from torch.utils.data import IterableDataset

# numpy kinds with no tensor dtype: Python objects, bytes, text, raw records.
NOT_NUMERIC = "OSUV"
IN_WORKERS = (
    "torch_batches cannot run in DataLoader worker processes: each would sample its own copy of "
    "the replay buffer, which its feed does not fill. Use num_workers=0 (the feed already runs "
    "beside the training loop)"
)


def torch_batches(
    buffer: ReplayBuffer,
    batch_size: int,
    *,
    timeout_s: float | None = None,
    batches: int | None = None,
    device: torch.device | str | None = None,
) -> IterableDataset[dict[str, torch.Tensor]]:
    """An iterable of `buffer.sample(batch_size, timeout_s)` batches as dicts of tensors:
    `batches` of them (None: for ever, until the buffer closes or its feed fails, which raise)."""
    if batches is not None and batches < 0:
        raise ValueError(f"batches must be at least 0 (or None: for ever), not {batches}")
    return _dataset_type()(buffer, batch_size, timeout_s, batches, device)


@functools.cache
def _dataset_type() -> Callable[
    [ReplayBuffer, int, float | None, int | None, torch.device | str | None],
    IterableDataset[dict[str, torch.Tensor]],
]:
    """The datasets' class, made once torch is imported."""
    try:
        import torch
        from torch.utils.data import IterableDataset, get_worker_info
    except ImportError as error:
        raise ImportError(
            "torch_batches needs PyTorch, which cogment-aux does not install: pip install torch"
        ) from error

    class ReplayBatches(IterableDataset[dict[str, torch.Tensor]]):
        def __init__(
            self,
            buffer: ReplayBuffer,
            batch_size: int,
            timeout_s: float | None,
            batches: int | None,
            device: torch.device | str | None,
        ) -> None:
            self.buffer = buffer
            self.batch_size = batch_size
            self.timeout_s = timeout_s
            self.batches = batches
            self.device = None if device is None else torch.device(device)

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            if get_worker_info() is not None:  # a forked worker: it has a copy
                raise RuntimeError(IN_WORKERS)
            taken = 0
            while self.batches is None or taken < self.batches:
                batch = self.buffer.sample(self.batch_size, self.timeout_s)
                yield {name: self._tensor(name, array) for name, array in batch.items()}
                taken += 1

        def __reduce__(self) -> tuple[Any, ...]:
            # A spawned worker gets a pickled copy: say why there is none, not what fails to pickle.
            raise TypeError(IN_WORKERS)

        def _tensor(self, name: str, array: npt.NDArray[Any]) -> torch.Tensor:
            if array.dtype.kind in NOT_NUMERIC:
                raise TypeError(
                    f"batch column {name!r} holds {array.dtype} values (undecoded payloads), which "
                    "have no tensor: give the buffer decoders (decode_observation=, decode_action=)"
                )
            tensor = torch.from_numpy(array)
            if self.device is None or name == "keys":  # keys go back to update_priorities
                return tensor
            return tensor.to(self.device)

    return ReplayBatches
