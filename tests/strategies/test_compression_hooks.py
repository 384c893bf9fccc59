"""Top-K / QSGD pieces without processes: QSGD packing and unbiasedness, per-parameter state across bucket layouts,
and the strategy's argument checks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_accel.strategies._bucket_state import BucketStateMover
from lightning_accel.strategies.compression_hooks import (
    QSGDState,
    qsgd_bits,
    qsgd_decode,
    qsgd_encode,
    qsgd_variance_bound,
)
from lightning_accel.strategies.ddp_compression import DDPCompressionStrategy, ddp_qsgd, ddp_topk


@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (7, 4), (127, 8)])
def test_qsgd_packs_sign_and_level_in_bits_plus_one_norm_per_chunk_and_is_unbiased(levels, bits):
    assert qsgd_bits(levels) == bits
    state = QSGDState(levels=levels, chunk_size=64)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload = qsgd_encode(g, state)
    assert payload.dtype == torch.uint8
    assert payload.numel() == math.ceil(1000 * bits / 8) + 4 * math.ceil(1000 / 64)
    once = qsgd_decode(payload, 1000, state)
    chunk_norms = g[:64].norm()
    # every decoded entry is a level of its chunk's norm, with the entry's sign (or zero)
    levels_seen = (once[:64].abs() / chunk_norms * levels).round()
    assert torch.allclose(once[:64].abs(), levels_seen * chunk_norms / levels, atol=1e-6)
    assert bool(((once == 0) | (once.sign() == g.sign())).all())
    mean = sum(qsgd_decode(qsgd_encode(g, state), 1000, state) for _ in range(3000)) / 3000
    # unbiased: the mean of many draws approaches g (the spread shrinks as 1/sqrt(draws))
    assert (mean - g).abs().max() < 0.15 * g.abs().max()
    assert (mean - g).norm() < 0.1 * g.norm()


def test_qsgd_levels_beyond_8_bits_are_rejected():
    with pytest.raises(ValueError, match="levels=200"):
        qsgd_bits(200)


def test_bucket_state_follows_its_parameters_into_another_layout():
    shapes = [(64, 32), (64,), (8, 64), (8,)]
    mover = BucketStateMover(shapes, ("error_dict", "p_memory_dict", "q_memory_dict"), powersgd=(4, 2.0))
    state = SimpleNamespace(error_dict={}, p_memory_dict={}, q_memory_dict={})
    first = [3, 2, 1, 0]  # DDP's initial order: reverse
    mover.enter(state, 0, first, torch.device("cpu"))
    numel = sum(math.prod(s) for s in shapes)
    # 64x32 compresses at rank 4 ((64+32)*4*2 < 2048), 8x64 does not ((8+64)*4*2 = 576 > 512)
    assert mover.segments("p_memory_dict", first) == [(0, 64 * 4)]
    assert mover.segments("q_memory_dict", first) == [(0, 32 * 4)]
    state.error_dict[0] = torch.cat([torch.full((math.prod(shapes[i]),), float(i)) for i in first])
    state.p_memory_dict[0] = torch.full((256,), 7.0)
    state.q_memory_dict[0] = torch.full((128,), 9.0)
    pieces = mover.state_pieces(state)
    assert sorted(pieces["error_dict"]) == [0, 1, 2, 3] and sorted(pieces["p_memory_dict"]) == [0]
    rebuilt = [2, 3, 0, 1]  # DDP's rebuilt order: gradient-ready
    mover.enter(state, 0, rebuilt, torch.device("cpu"))
    assert state.error_dict[0].numel() == numel
    expected = torch.cat([torch.full((math.prod(shapes[i]),), float(i)) for i in rebuilt])
    assert torch.equal(state.error_dict[0], expected)
    assert torch.equal(state.p_memory_dict[0], torch.full((256,), 7.0))
    # a new mover (a resumed run) fed the saved pieces assembles the same tensors for yet another layout
    resumed = BucketStateMover(shapes, ("error_dict", "p_memory_dict", "q_memory_dict"), powersgd=(4, 2.0))
    resumed.pieces = {name: dict(store) for name, store in pieces.items()}
    fresh = SimpleNamespace(error_dict={}, p_memory_dict={}, q_memory_dict={})
    resumed.enter(fresh, 0, [0, 1], torch.device("cpu"))
    resumed.enter(fresh, 1, [2, 3], torch.device("cpu"))
    assert torch.equal(fresh.error_dict[0], torch.cat([torch.zeros(2048), torch.ones(64)]))
    assert torch.equal(fresh.error_dict[1], torch.cat([torch.full((512,), 2.0), torch.full((8,), 3.0)]))
    assert 1 not in fresh.p_memory_dict and torch.equal(fresh.q_memory_dict[0], torch.full((128,), 9.0))


def test_topk_and_qsgd_defaults_and_bad_input():
    topk, qsgd = ddp_topk(), ddp_qsgd()
    assert topk.string == "ddp_topk" and topk._hook_kwargs == {
        "use_error_feedback": True,
        "start_iter": 2,
        "density": 0.01,
        "density_warmup_steps": 64,
        "density_warmup": None,
    }
    assert topk.momentum_correction is None and topk.adaptive_warmup_steps == 100
    assert qsgd._hook_kwargs == {
        "use_error_feedback": False,
        "start_iter": 0,
        "levels": 7,
        "chunk_size": 128,
        "seed": 0,
    }
    with pytest.raises(ValueError, match="density=0"):
        ddp_topk(density=0)
    with pytest.raises(ValueError, match="density=1.5"):
        ddp_topk(density=1.5)
    with pytest.raises(ValueError, match="start_iter=1 must be >= 2 with error feedback"):
        ddp_topk(start_iter=1)
    with pytest.raises(ValueError, match="levels=0"):
        ddp_qsgd(levels=0)
    with pytest.raises(ValueError, match="levels=128"):
        ddp_qsgd(levels=128)
    with pytest.raises(ValueError, match="chunk_size=0"):
        ddp_qsgd(chunk_size=0)
    # error feedback needs a contractive quantiser: 7 levels over 128 entries (bound 1.6) would diverge
    assert qsgd_variance_bound(7, 128) > 1 > qsgd_variance_bound(127, 512)
    with pytest.raises(ValueError, match="diverges"):
        ddp_qsgd(use_error_feedback=True)
    ddp_qsgd(use_error_feedback=True, levels=127, chunk_size=512)
    with pytest.raises(ValueError, match="'topK'"):
        DDPCompressionStrategy(compression="topK")  # type: ignore[arg-type]


class _OneBucket:
    def __init__(self, values):
        self._buffer = torch.tensor(values)

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def is_last(self):
        return True


def _one_process(monkeypatch):
    """The hook's collectives over one process: the all-gather returns this rank's own payload."""
    from lightning_accel.strategies import compression_hooks

    def gather(state, payload):
        state.bytes_sent += payload.numel() * payload.element_size()
        fut = torch.futures.Future()
        fut.set_result([[payload.clone()]])
        return fut

    monkeypatch.setattr(compression_hooks, "_all_gather", gather)
    monkeypatch.setattr(compression_hooks.dist, "get_world_size", lambda group=None: 1)


def test_topk_sends_the_largest_entries_and_keeps_the_rest_for_the_next_step(monkeypatch):
    from lightning_accel.strategies.compression_hooks import TopKState, topk_hook

    _one_process(monkeypatch)
    state = TopKState(density=0.25, start_iter=0)  # 8 entries -> k = 2
    g = [0.5, -3.0, 1.0, 0.2, -2.0, 0.1, 4.0, -0.3]
    bucket = _OneBucket(g)
    sent = topk_hook(state, bucket).wait()
    assert sent.tolist() == [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0]  # the two largest magnitudes, as they were
    residual = state.error_dict[0]
    assert residual.tolist() == pytest.approx([0.5, 0.0, 1.0, 0.2, -2.0, 0.1, 0.0, -0.3])
    assert torch.equal(sent + residual, torch.tensor(g))  # nothing lost: sent + kept = the gradient
    assert state.bytes_sent == 2 * 4 + 2 * 4  # two fp32 values + two int32 indices
    # the next step sends from its gradient plus what the last one kept: -2 + 0.1 and 1 + 0.1 win, not 0.1s
    second = topk_hook(state, _OneBucket([0.1] * 8)).wait()
    assert second.tolist() == pytest.approx([0.0, 0.0, 1.1, 0.0, -1.9, 0.0, 0.0, 0.0])
    assert state.error_dict[0].tolist() == pytest.approx([0.6, 0.1, 0.0, 0.3, 0.0, 0.2, 0.1, -0.2])
    assert state.iter == 2


def test_topk_without_error_feedback_forgets_the_unsent_entries(monkeypatch):
    from lightning_accel.strategies.compression_hooks import TopKState, topk_hook

    _one_process(monkeypatch)
    state = TopKState(density=0.25, start_iter=0, use_error_feedback=False)
    topk_hook(state, _OneBucket([0.5, -3.0, 1.0, 0.2, -2.0, 0.1, 4.0, -0.3])).wait()
    assert state.error_dict == {}
    second = topk_hook(state, _OneBucket([0.1, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.3])).wait()
    assert second.tolist() == pytest.approx([0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3])
