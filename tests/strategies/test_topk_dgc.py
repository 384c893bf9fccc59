"""Deep Gradient Compression's recipe in ``ddp_topk`` without processes: the density warm-up, momentum correction
with factor masking on known vectors, the optimizer's momentum switched off for compressed steps only, the plain
all-reduce warm-up for Adam-family optimizers, the schedule across a checkpoint, and the argument checks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lightning_accel.strategies import compression_hooks
from lightning_accel.strategies.compression_hooks import (
    TopKState,
    scheduled_density,
    topk_hook,
    warmup_densities,
)
from lightning_accel.strategies.ddp_compression import (
    DEFAULT_ADAPTIVE_WARMUP_STEPS,
    DEFAULT_DENSITY_WARMUP_STEPS,
    ddp_topk,
)
from tests.strategies.test_compression_hooks import _one_process, _OneBucket


def _plain_allreduce_in_one_process(monkeypatch):
    """The warm-up's all-reduce over one process: the sum is this rank's own buffer."""

    class Done:
        def __init__(self, tensor):
            self.tensor = tensor

        def get_future(self):
            fut = torch.futures.Future()
            fut.set_result([self.tensor])
            return fut

    monkeypatch.setattr(compression_hooks.dist, "all_reduce", lambda t, group=None, async_op=False: Done(t))


def test_density_warmup_follows_dgc_ramp_then_the_target(monkeypatch):
    assert warmup_densities(0.01) == (0.25, 0.0625, 0.015625)  # DGC: 25 % -> 6.25 % -> 1.5625 % -> target
    assert warmup_densities(0.25) == () and warmup_densities(0.05) == (0.25, 0.0625)
    assert [scheduled_density(0.01, s, 3) for s in (0, 2, 3, 5, 6, 8, 9, 100)] == [
        0.25,
        0.25,
        0.0625,
        0.0625,
        0.015625,
        0.015625,
        0.01,
        0.01,
    ]
    assert scheduled_density(0.01, 0, 0) == 0.01  # 0 steps per stage: no warm-up
    _one_process(monkeypatch)
    _plain_allreduce_in_one_process(monkeypatch)
    n = 400
    state = TopKState(density=0.01, start_iter=2, density_warmup_steps=2)
    sent, densities = [], []
    for _ in range(10):
        densities.append(state.current_density)
        before = state.bytes_sent
        topk_hook(state, _OneBucket([float(i % 7) - 3.0 for i in range(n)])).wait()
        sent.append(state.bytes_sent - before)
    # 2 plain steps (fp32 buffer), then k = ceil(density * n) values + int32 indices per step
    k = [math.ceil(d * n) for d in (0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01)]
    assert sent == [4 * n, 4 * n] + [8 * x for x in k]
    # the density in use is observable; it counts from the first compressed step (the warm-up's plain steps apart)
    assert densities == [0.25, 0.25, 0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    # ddp_topk's defaults: DGC's ramp, 64 compressed steps per stage
    strategy = ddp_topk()
    assert strategy._hook_kwargs["density_warmup_steps"] == DEFAULT_DENSITY_WARMUP_STEPS == 64
    state, _ = strategy._base_hook()
    state.iter = 2 + 64 * 2
    assert state.density_warmup == (0.25, 0.0625, 0.015625) and state.current_density == 0.015625
    state.iter = 2 + 64 * 3
    assert state.current_density == 0.01


def test_momentum_correction_accumulates_velocity_and_masks_it_where_sent(monkeypatch):
    _one_process(monkeypatch)
    state = TopKState(density=0.25, start_iter=0, momentum=0.5)  # 8 entries -> k = 2
    g = [0.5, -3.0, 1.0, 0.2, -2.0, 0.1, 4.0, -0.3]
    first = topk_hook(state, _OneBucket(g)).wait()
    # u = g, v = u: the two largest of v go, and u and v are zeroed there
    assert first.tolist() == [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0]
    kept = [0.5, 0.0, 1.0, 0.2, -2.0, 0.1, 0.0, -0.3]
    assert state.momentum_dict[0].tolist() == pytest.approx(kept)
    assert state.error_dict[0].tolist() == pytest.approx(kept)
    assert state.momentum_dict[0].data_ptr() != state.error_dict[0].data_ptr()  # v does not alias u
    second = topk_hook(state, _OneBucket([0.1] * 8)).wait()
    # u = 0.5 u + 0.1 = [.35 .1 .6 .2 -.9 .15 .1 -.05]; v += u = [.85 .1 1.6 .4 -2.9 .25 .1 -.35]: -2.9 and 1.6 go
    assert second.tolist() == pytest.approx([0.0, 0.0, 1.6, 0.0, -2.9, 0.0, 0.0, 0.0])
    # factor masking: the velocity of the sent entries is dropped too (without it u would keep 0.6 and -0.9)
    assert state.momentum_dict[0].tolist() == pytest.approx([0.35, 0.1, 0.0, 0.2, 0.0, 0.15, 0.1, -0.05])
    assert state.error_dict[0].tolist() == pytest.approx([0.85, 0.1, 0.0, 0.4, 0.0, 0.25, 0.1, -0.35])
    assert state.last_compressed


def test_momentum_correction_nesterov_selects_from_g_plus_m_u(monkeypatch):
    _one_process(monkeypatch)
    state = TopKState(density=0.25, start_iter=0, momentum=0.5, nesterov=True)
    g = [0.5, -3.0, 1.0, 0.2, -2.0, 0.1, 4.0, -0.3]
    sent = topk_hook(state, _OneBucket(g)).wait()
    # torch's Nesterov: buf = g, update = g + m·buf = 1.5 g; the hook's u = m·(u + g) = 0.5 g, v = u + g
    assert sent.tolist() == pytest.approx([0.0, -4.5, 0.0, 0.0, 0.0, 0.0, 6.0, 0.0])
    assert state.momentum_dict[0].tolist() == pytest.approx([0.25, 0.0, 0.5, 0.1, -1.0, 0.05, 0.0, -0.15])


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def test_sgd_steps_without_its_momentum_on_compressed_steps_only():
    strategy = ddp_topk()
    state, _ = strategy._base_hook()
    module = _Module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    strategy.configure_topk_for_optimizers([optimizer])
    assert state.momentum == 0.9 and not state.nesterov and state.start_iter == 2
    grads = iter([torch.ones(3), torch.full((3,), 2.0)])

    def backward(compressed):
        def closure():
            module.w.grad = next(grads)
            state.last_compressed = compressed  # what the hook records for this backward
            return None

        return closure

    def step(compressed):
        closure = strategy._momentum_off_when_compressed(optimizer, backward(compressed), [(0, 0.9)])
        optimizer.step(closure)
        optimizer.param_groups[0]["momentum"] = 0.9  # what optimizer_step restores afterwards

    step(False)  # a warm-up step: SGD's own momentum, buf = 1
    assert module.w.tolist() == pytest.approx([-0.1] * 3)
    step(True)  # compressed: the hook applied momentum already; SGD must step by lr·g = 0.2, not lr·(0.9·1 + 2)
    assert module.w.tolist() == pytest.approx([-0.3] * 3)
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_optimizer_detection_momentum_sgd_adam_family_and_errors():
    def params():
        return [torch.nn.Parameter(torch.zeros(2))]

    strategy = ddp_topk()
    state, _ = strategy._base_hook()
    # SGD without momentum: nothing to correct, no warm-up
    strategy.configure_topk_for_optimizers([torch.optim.SGD(params(), lr=0.1)])
    assert state.momentum == 0.0 and state.start_iter == 2 and strategy._momentum_groups == {}
    nesterov = torch.optim.SGD(params(), lr=0.1, momentum=0.8, nesterov=True)
    strategy.configure_topk_for_optimizers([nesterov])
    assert (state.momentum, state.nesterov) == (0.8, True)
    assert strategy._momentum_groups == {id(nesterov): [(0, 0.8)]}
    off = ddp_topk(momentum_correction=False)
    off_state, _ = off._base_hook()
    off.configure_topk_for_optimizers([torch.optim.SGD(params(), lr=0.1, momentum=0.9)])
    assert off_state.momentum == 0.0 and off._momentum_groups == {}
    # without error feedback there is no residual to accumulate the velocity in: SGD keeps its own momentum
    plain = ddp_topk(use_error_feedback=False, start_iter=0)
    plain_state, _ = plain._base_hook()
    plain.configure_topk_for_optimizers([torch.optim.SGD(params(), lr=0.1, momentum=0.9)])
    assert plain_state.momentum == 0.0 and plain._momentum_groups == {}
    mixed = torch.optim.SGD([{"params": params(), "momentum": 0.9}, {"params": params(), "momentum": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match=r"momentum \[0.5, 0.9\]: use one value, or momentum_correction=False"):
        strategy.configure_topk_for_optimizers([mixed])
    with pytest.raises(ValueError, match=r"dampening=\[0.1\]"):
        strategy.configure_topk_for_optimizers([torch.optim.SGD(params(), lr=0.1, momentum=0.9, dampening=0.1)])
    required = ddp_topk(momentum_correction=True)
    required._base_hook()
    with pytest.raises(ValueError, match=r"momentum_correction=True needs torch.optim.SGD .* \['AdamW'\]"):
        required.configure_topk_for_optimizers([torch.optim.AdamW(params())])

    class ThirdPartyAdam(torch.optim.Optimizer):  # Adam-like: detected by its betas
        def __init__(self, p):
            super().__init__(p, {"lr": 1e-3, "betas": (0.9, 0.999)})

    for optimizer in (torch.optim.Adam(params()), torch.optim.RMSprop(params()), ThirdPartyAdam(params())):
        adam = ddp_topk()
        adam_state, _ = adam._base_hook()
        with pytest.warns(UserWarning, match="diverge or converge worse"):
            adam.configure_topk_for_optimizers([optimizer])
        assert adam_state.start_iter == DEFAULT_ADAPTIVE_WARMUP_STEPS == 100 and adam_state.momentum == 0.0


def test_adam_family_all_reduces_plainly_for_the_warmup_then_compresses_and_warns_once(monkeypatch):
    _one_process(monkeypatch)
    _plain_allreduce_in_one_process(monkeypatch)
    strategy = ddp_topk(adaptive_warmup_steps=5, density_warmup_steps=0)
    state, _ = strategy._base_hook()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.configure_topk_for_optimizers([torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])])
        n = 200
        sent, compressed = [], []
        for _ in range(8):
            before = state.bytes_sent
            topk_hook(state, _OneBucket([float(i) for i in range(n)])).wait()
            sent.append(state.bytes_sent - before)
            compressed.append(state.last_compressed)
    risk = [w for w in caught if "adaptive optimizers on sparsified gradients" in str(w.message)]
    assert len(risk) == 1
    message = str(risk[0].message)
    assert "\n" not in message and "AdamW" in message and "first 5 steps" in message
    assert sent == [4 * n] * 5 + [8 * 2] * 3  # 5 plain all-reduce steps, then 1 % = 2 entries
    assert compressed == [False] * 5 + [True] * 3
    # start_iter is the larger of the two warm-ups
    longer = ddp_topk(adaptive_warmup_steps=1, start_iter=7)
    longer_state, _ = longer._base_hook()
    with pytest.warns(UserWarning, match="first 7 steps"):
        longer.configure_topk_for_optimizers([torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])])
    assert longer_state.start_iter == 7


def test_resume_keeps_the_density_schedule_position_and_old_checkpoints_load():
    first = ddp_topk(density_warmup_steps=4)
    state, _ = first._base_hook()
    state.iter = 2 + 4 + 3  # compressed step 7: the second stage
    assert state.current_density == 0.0625
    saved = first.compression_state_dict()
    assert saved["ranks"][0]["density"] == 0.0625 and saved["ranks"][0]["iter"] == 9
    resumed = ddp_topk(density_warmup_steps=4)
    resumed.load_compression_state_dict(saved)
    resumed_state, _ = resumed._base_hook()
    assert resumed_state.iter == 9 and resumed_state.current_density == 0.0625
    resumed_state.iter += 3
    assert resumed_state.current_density == 0.015625  # the ramp continues where it was
    # a checkpoint of an earlier release (no density recorded) loads: the counter alone sets the position
    old = {**saved, "ranks": [{k: v for k, v in saved["ranks"][0].items() if k != "density"}]}
    again = ddp_topk(density_warmup_steps=4)
    again.load_compression_state_dict(old)
    again_state, _ = again._base_hook()
    assert again_state.iter == 9 and again_state.current_density == 0.0625


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density_warmup_steps": -1}, r"density_warmup_steps=-1 must be an integer >= 0 .* 0 turns the warm-up off"),
        ({"density_warmup_steps": 1.5}, r"density_warmup_steps=1.5"),
        ({"density_warmup": [0.25, 0.0]}, r"density_warmup=\[0.25, 0.0\] holds 0.0: .* fraction in \(0, 1\]"),
        ({"density_warmup": 0.25}, r"density_warmup=0.25 must be a list of densities"),
        ({"momentum_correction": "yes"}, r"momentum_correction='yes' must be None"),
        (
            {"momentum_correction": True, "use_error_feedback": False, "start_iter": 0},
            r"momentum_correction=True needs use_error_feedback=True",
        ),
        ({"adaptive_warmup_steps": -5}, r"adaptive_warmup_steps=-5 must be an integer >= 0"),
    ],
)
def test_bad_recipe_arguments_name_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ddp_topk(**kwargs)


def test_topk_state_refuses_momentum_without_error_feedback_and_bad_factor():
    with pytest.raises(ValueError, match=r"momentum=0.9\) needs use_error_feedback=True"):
        TopKState(density=0.01, momentum=0.9, use_error_feedback=False)
    with pytest.raises(ValueError, match=r"factor=1.5 must be in \(0, 1\)"):
        warmup_densities(0.01, factor=1.5)
