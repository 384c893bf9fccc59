"""The per-epoch DDP plan: disjoint, covering, equal batch counts, reshuffled per epoch, identical across ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_accel.data.sharding import epoch_plan, num_batches


def plans(n, bs, world, policy, epoch=0, shuffle=True, seed=3):
    return [
        epoch_plan(
            n, batch_size=bs, rank=r, world_size=world, shuffle=shuffle, seed=seed, epoch=epoch, last_batch=policy
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("n,bs,world", list(itertools.product([7, 24, 25, 64, 101], [1, 4, 8], [1, 2, 3])))
def test_drop_pad_partial_contracts(n, bs, world):
    # drop: equal full batches, no sample twice
    if n // world >= bs:
        ps = plans(n, bs, world, "drop")
        seen = np.concatenate([b for p in ps for b in p])
        assert {len(p) for p in ps} == {num_batches(n, batch_size=bs, world_size=world, last_batch="drop")}
        assert all(len(b) == bs for p in ps for b in p)
        assert len(np.unique(seen)) == len(seen) and len(seen) > n - world * bs - world
    # pad: equal full batches, every sample at least once, the extra ones are fewer than one global batch
    ps = plans(n, bs, world, "pad")
    seen = np.concatenate([b for p in ps for b in p])
    assert {len(p) for p in ps} == {num_batches(n, batch_size=bs, world_size=world, last_batch="pad")}
    assert all(len(b) == bs for p in ps for b in p)
    assert set(seen.tolist()) == set(range(n)) and len(seen) - n < max(world * bs, n + 1)
    # partial (validation): every sample exactly once; equal batch counts unless a rank has too few samples
    if n >= world:
        ps = plans(n, bs, world, "partial", shuffle=False)
        seen = np.concatenate([b for p in ps for b in p])
        assert sorted(seen.tolist()) == list(range(n))
        assert all(1 <= len(b) <= bs for p in ps for b in p)
        expected = num_batches(n, batch_size=bs, world_size=world, last_batch="partial")
        for p in ps:
            assert len(p) == expected or (len(p) == expected - 1 and sum(map(len, p)) < expected)


def test_shuffle_depends_on_seed_and_epoch_only():
    a0, b0 = plans(40, 4, 2, "drop", epoch=0)
    again = plans(40, 4, 2, "drop", epoch=0)
    a1, _ = plans(40, 4, 2, "drop", epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a0, again[0]))  # same on every call (every rank agrees)
    assert not all(np.array_equal(x, y) for x, y in zip(a0, a1))  # reshuffled next epoch
    assert set(np.concatenate(a0)).isdisjoint(np.concatenate(b0))


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="last_batch='pad'"):
        epoch_plan(5, batch_size=4, rank=0, world_size=2, shuffle=True, seed=0, epoch=0, last_batch="drop")
    with pytest.raises(ValueError, match="rank"):
        epoch_plan(5, batch_size=1, rank=2, world_size=2, shuffle=True, seed=0, epoch=0, last_batch="pad")
    with pytest.raises(ValueError, match="last_batch must be"):
        num_batches(5, batch_size=1, world_size=1, last_batch="fill")
    with pytest.raises(ValueError, match="empty"):
        num_batches(0, batch_size=1, world_size=1, last_batch="pad")
