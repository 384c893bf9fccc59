"""Whether a plan was made for this run (core/autopilot/plan.py): the model's fingerprint and each difference named."""

from __future__ import annotations

import torch
from torch import nn

from lightning_accel.core.autopilot import AutopilotPlan, model_fingerprint, plan_misfit

RUN = {"fingerprint": "f" * 16, "device": "cpu", "world_size": 1, "global_batch": 32}


def test_the_fingerprint_follows_the_architecture_not_the_weights():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    b = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 3)))
    assert model_fingerprint(a) != model_fingerprint(a.to(torch.float64))
    assert model_fingerprint(torch.compile(a)) == model_fingerprint(a)


def test_a_plan_of_this_run_fits():
    assert plan_misfit(AutopilotPlan(**RUN), **RUN) is None


def test_each_difference_is_named_with_both_values():
    plan = AutopilotPlan(model="GPT", fingerprint="0" * 16, device="cuda", world_size=8, global_batch=256)
    why = plan_misfit(plan, **RUN)
    assert why is not None
    assert f"the model (the plan's GPT has parameter fingerprint {'0' * 16}, this run's {'f' * 16}" in why
    assert "the device type (plan: cuda, this run: cpu)" in why
    assert "the number of devices (plan: 8, this run: 1)" in why
    assert "the global batch (plan: 256 samples per optimizer step, this run: 32)" in why


def test_what_an_older_plan_does_not_record_is_not_compared():
    assert plan_misfit(AutopilotPlan(world_size=1), **RUN) is None
    assert plan_misfit(AutopilotPlan(world_size=1, global_batch=64), **{**RUN, "global_batch": None}) is None
