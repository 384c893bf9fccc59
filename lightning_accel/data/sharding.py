"""Which samples each rank reads in one epoch: the ``DistributedSampler`` contract, as a pure function.

``DALIImageDataModule`` feeds DALI from this plan instead of DALI's reader-side sharding because the plan gives
the guarantees a DDP run needs and DALI's readers do not all give: a global shuffle that changes every epoch and
is identical on every rank (``seed`` + ``epoch``, like ``torch.utils.data.DistributedSampler.set_epoch``), disjoint
rank shards, the same number of batches on every rank (so no rank waits forever in an all-reduce), and for
validation no sample counted twice. (DALI's ``readers.file`` shuffles only *after* the first epoch with
``shuffle_after_epoch``; its other readers shuffle within a buffer of ``initial_fill`` samples of one contiguous
shard.)
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["LAST_BATCH_POLICIES", "epoch_plan", "num_batches"]

#: ``drop``: every rank gets ``len // world_size`` samples, the partial last batch is dropped (the method's
#: ``drop_last=True``); ``pad``: the shuffled order wraps around to fill the last batch on every rank (a few samples
#: are seen twice per epoch); ``partial`` (validation): every sample exactly once, equal batch counts by splitting.
LAST_BATCH_POLICIES = ("drop", "pad", "partial")


def _order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    # same generator on every rank: the permutation depends on (seed, epoch) only
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


def _check(num_samples: int, batch_size: int, rank: int, world_size: int, last_batch: str) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    if num_samples < 1:
        raise ValueError("the data set is empty (0 samples)")
    if last_batch == "drop" and num_samples // world_size < batch_size:
        raise ValueError(
            f"{num_samples} samples over {world_size} rank(s) do not fill one batch of {batch_size} per rank, so "
            f"last_batch='drop' leaves nothing to train on: lower the batch size or use last_batch='pad'"
        )
    if last_batch == "partial" and num_samples < world_size:
        raise ValueError(f"{num_samples} samples cannot give each of {world_size} ranks at least one sample")


def num_batches(num_samples: int, *, batch_size: int, world_size: int, last_batch: str) -> int:
    """Batches per rank per epoch (the same on every rank; see :func:`epoch_plan` for one exception)."""
    _check(num_samples, batch_size, 0, world_size, last_batch)
    if last_batch == "drop":
        return (num_samples // world_size) // batch_size
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)


def epoch_plan(
    num_samples: int,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    last_batch: str,
) -> list[np.ndarray]:
    """The batches (arrays of sample indices) ``rank`` reads in ``epoch``.

    Rank ``r`` takes every ``world_size``-th sample of the epoch's order starting at ``r`` (as
    ``DistributedSampler`` does). With ``partial``, a rank whose share would leave its last batch empty splits its
    largest batches so that every rank still runs :func:`num_batches` batches; only when a rank has fewer samples
    than that (``batch_size=1`` and ``num_samples % world_size != 0``) does it run one batch fewer.
    """
    _check(num_samples, batch_size, rank, world_size, last_batch)
    order = _order(num_samples, shuffle=shuffle, seed=seed, epoch=epoch)
    n_batches = num_batches(num_samples, batch_size=batch_size, world_size=world_size, last_batch=last_batch)
    if last_batch == "drop":
        per_rank = num_samples // world_size
        mine = order[: per_rank * world_size][rank::world_size][: n_batches * batch_size]
        return list(mine.reshape(n_batches, batch_size))
    if last_batch == "pad":
        total = n_batches * batch_size * world_size
        mine = np.resize(order, total)[rank::world_size]  # np.resize repeats the order cyclically
        return list(mine.reshape(n_batches, batch_size))
    mine = order[rank::world_size]
    sizes = [batch_size] * (len(mine) // batch_size) + ([len(mine) % batch_size] if len(mine) % batch_size else [])
    while len(sizes) < n_batches and max(sizes) > 1:
        largest = sizes.index(max(sizes))
        half = sizes[largest] // 2
        sizes[largest : largest + 1] = [sizes[largest] - half, half]
    return np.split(mine, np.cumsum(sizes)[:-1])
