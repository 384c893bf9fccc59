"""ProfileWindow: exactly N profiled steps, nothing outside the window, on request, files and bad input."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import ProfileWindow


class Model(pl.LightningModule):
    def __init__(self, request_at=None, window=None):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.request_at, self.window = request_at, window
        self.profiler_on = {}
        self.accepted = []

    def training_step(self, batch, batch_idx):
        step = self.global_step
        self.profiler_on[step] = torch.autograd._profiler_enabled()
        if self.request_at is not None and step in self.request_at:
            self.accepted.append(self.window.request(f"finding at step {step}"))
        with torch.profiler.record_function(f"mark_step_{step}"):
            return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4)


def fit(window, model=None, max_steps=12, tmp_path=None):
    model = model or Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[window],
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    return model


def trace_names(path):
    events = json.loads(open(path).read())["traceEvents"]
    steps = [e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")]
    marks = sorted(int(e["name"].rsplit("_", 1)[1]) for e in events if e.get("name", "").startswith("mark_step_"))
    return steps, marks


@pytest.mark.parametrize("wait, warmup, active", [(1, 1, 3), (0, 2, 1)])
def test_at_step_records_exactly_active_steps_and_nothing_outside(tmp_path, wait, warmup, active):
    window = ProfileWindow(dirpath=tmp_path / "prof", at_step=4, wait=wait, warmup=warmup, active=active)
    model = fit(window)
    assert len(window.windows) == 1
    info = window.windows[0]
    first = 4 + wait + warmup
    assert info["start_step"] == 4 and info["steps_recorded"] == active and info["reason"] == "at_step=4"
    steps, marks = trace_names(info["trace"])
    assert len(steps) == active
    assert marks == list(range(first, first + active))  # the training steps in the trace: the window's only
    # the profiler ran only while the window was open (wait steps included: it exists but does not record)
    on = sorted(step for step, enabled in model.profiler_on.items() if enabled)
    assert on and on[0] >= 4 and on[-1] == first + active - 1
    assert not model.profiler_on[first + active] and not model.profiler_on[3]
    table = open(info["table"]).read()
    assert f"recorded global steps {first}..{first + active - 1} ({active} steps" in table
    assert "self_cpu_time_total" in table and "Self CPU" in table and "aten::addmm" in table
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "top_ops_step4_rank0.txt",
        "trace_step4_rank0.json",
    ]


def test_request_opens_one_window_at_the_next_batch(tmp_path):
    window = ProfileWindow(wait=0, warmup=1, active=2)
    model = Model(request_at={2, 3, 8}, window=window)
    assert window.request("before fit") is True and window.request("again") is False  # one pending at a time
    window._pending = None  # drop the pre-fit request: the one from inside training is tested
    fit(window, model, tmp_path=tmp_path)
    # step 2 accepted; step 3 refused (window open); step 8 refused (max_windows=1 used)
    assert model.accepted == [True, False, False]
    (info,) = window.windows
    assert info["reason"] == "finding at step 2" and info["start_step"] == 3
    steps, marks = trace_names(info["trace"])
    assert len(steps) == 2 and marks == [4, 5]
    assert "reason: finding at step 2" in open(info["table"]).read()
    assert info["trace"].startswith(str(tmp_path / "profile"))  # default dirpath: default_root_dir/profile


def test_fit_ending_mid_window_writes_what_was_recorded_and_warns(tmp_path):
    window = ProfileWindow(dirpath=tmp_path, at_step=8, wait=0, warmup=1, active=5)
    with pytest.warns(UserWarning, match="2 of 5 recorded steps"):
        fit(window, max_steps=11)
    (info,) = window.windows
    assert info["steps_recorded"] == 2
    steps, marks = trace_names(info["trace"])
    assert marks == [9, 10]
    assert not list(tmp_path.glob("*.tmp"))


def test_state_dict_round_trip():
    window = ProfileWindow(at_step=3)
    window.windows.append({"reason": "r", "start_step": 3})
    window._at_step_done = True
    other = ProfileWindow(at_step=3)
    other.load_state_dict(window.state_dict())
    assert other.windows == window.windows and other._at_step_done
    assert other.request("x") is False  # max_windows already used by the resumed run


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"active": 0}, "active=0"),
        ({"wait": -1}, "wait=-1"),
        ({"at_step": 1.5}, "at_step=1.5"),
        ({"max_windows": 0}, "max_windows=0"),
        ({"row_limit": True}, "row_limit=True"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfileWindow(**kwargs)
