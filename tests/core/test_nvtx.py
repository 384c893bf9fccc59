"""NVTX stage ranges with a mocked NVTX backend: names, domain, balanced push/pop, nothing inside compiled regions;
NsysCapture with a mocked profiler."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel.core import nvtx as nvtx_module
from lightning_accel.core.comm import CommRecorder, timed_comm_hook
from lightning_accel.core.nvtx import StageRanges, nvtx_range
from lightning_accel.core.stages import StageMachine


class MockNvtx:
    def __init__(self):
        self.calls: list[tuple] = []
        self._next = 0

    def push_range(self, message, domain):
        self.calls.append(("push", message, domain))

    def pop_range(self, domain):
        self.calls.append(("pop", domain))

    def start_range(self, message, domain):
        self._next += 1
        self.calls.append(("start", message, domain, self._next))
        return self._next

    def end_range(self, handle):
        self.calls.append(("end", handle))

    def balanced(self) -> bool:
        depth = 0
        for call in self.calls:
            depth += {"push": 1, "pop": -1}.get(call[0], 0)
            if depth < 0:
                return False
        starts = {c[3] for c in self.calls if c[0] == "start"}
        ends = [c[1] for c in self.calls if c[0] == "end"]
        return depth == 0 and sorted(ends) == sorted(starts)

    def pushed(self) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "push"]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.001
        return self.t


def test_stage_machine_pushes_one_range_per_open_stage_and_pauses_and_cancels_stay_balanced():
    mock = MockNvtx()
    machine = StageMachine(clock=FakeClock(), ranges=StageRanges(backend=mock))
    for _ in range(2):
        machine.batch_requested()
        machine.batch_arrived()
        machine.stage_start("transfer")
        machine.stage_start("forward")
        machine.stage_start("backward")
        machine.stage_start("optimizer")
        machine.step_end(samples=4)
    machine.batch_requested()
    machine.pause()  # validation: the data wait's range closes, and opens again on resume
    machine.resume()
    machine.batch_arrived()
    machine.stage_start("forward")
    machine.cancel()  # an exception inside the step: the open range is popped
    assert mock.balanced()
    assert mock.pushed() == ["data", "transfer", "forward", "backward", "optimizer"] * 2 + ["data", "data", "forward"]
    assert {c[-1] for c in mock.calls if c[0] in ("push", "pop")} == {"lightning_accel"}


def test_without_ranges_the_machine_emits_nothing(monkeypatch):
    mock = MockNvtx()
    monkeypatch.setattr(nvtx_module, "_default_backend", lambda: mock)
    monkeypatch.setattr(nvtx_module, "nvtx_unavailable", lambda: None)  # the mock is the backend
    machine = StageMachine(clock=FakeClock())
    machine.batch_requested()
    machine.batch_arrived()
    machine.stage_start("forward")
    machine.step_end()
    assert machine.ranges is None and mock.calls == []


def test_nothing_is_emitted_inside_a_compiled_region(monkeypatch):
    mock = MockNvtx()
    ranges = StageRanges(backend=mock)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    ranges.switch(None, "forward")
    assert ranges.start("communication") is None
    with nvtx_range("autopilot/trial", ranges):
        pass
    assert mock.calls == []


def test_comm_recorder_opens_a_communication_range_per_bucket_closed_on_completion():
    mock = MockNvtx()
    recorder = CommRecorder(clock=FakeClock())
    recorder.ranges = StageRanges(backend=mock)

    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket)
        return fut

    timed = timed_comm_hook(hook, recorder)
    for bucket in range(3):
        assert timed(None, torch.ones(bucket + 1)).wait().numel() == bucket + 1
    assert [c[:2] for c in mock.calls] == [
        ("start", "communication"),
        ("end", 1),
        ("start", "communication"),
        ("end", 2),
        ("start", "communication"),
        ("end", 3),
    ]
    assert mock.balanced()


def test_nvtx_range_context_manager_pops_on_error_and_checks_its_domain():
    mock = MockNvtx()
    with pytest.raises(KeyError):
        with nvtx_range("autopilot/trial compile", StageRanges(backend=mock)):
            raise KeyError("inside")
    assert mock.calls == [("push", "autopilot/trial compile", "lightning_accel"), ("pop", "lightning_accel")]
    with pytest.raises(ValueError, match="domain=''"):
        StageRanges(domain="")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=8)


def _trainer(callbacks, steps=6):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def test_bottleneck_doctor_nvtx_emits_the_stages_balanced(monkeypatch, tmp_path):
    from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

    mock = MockNvtx()
    monkeypatch.setattr(nvtx_module, "_default_backend", lambda: mock)
    monkeypatch.setattr(nvtx_module, "nvtx_unavailable", lambda: None)  # the mock is the backend
    doctor = BottleneckDoctor(
        nvtx=True,
        window=2,
        warmup_batches=1,
        report_path=False,
        print_report=False,
        utilisation=False,
        smells=False,
        warn=False,
    )
    _trainer([doctor]).fit(Tiny(), _loader())
    assert mock.balanced()
    assert {"data", "transfer", "forward", "backward", "optimizer"} <= set(mock.pushed())
    assert mock.pushed().count("forward") == 6
    with pytest.raises(ValueError, match="nvtx='yes'"):
        BottleneckDoctor(nvtx="yes")


class MockProfiler:
    def __init__(self):
        self.calls: list[str] = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")


class StepSpy(pl.Callback):
    def __init__(self, profiler):
        self.profiler, self.seen = profiler, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.global_step, list(self.profiler.calls)))


def test_nsys_capture_opens_the_range_between_the_chosen_steps_on_the_chosen_ranks():
    from lightning_accel.callbacks.nsys_capture import NsysCapture

    profiler = MockProfiler()
    capture = NsysCapture(start_step=2, stop_step=4, profiler=profiler)
    spy = StepSpy(profiler)
    _trainer([capture, spy]).fit(Tiny(), _loader())
    assert profiler.calls == ["start", "stop"] and capture.captured == [(2, 4)]
    # started before the batch that runs step 2, stopped after the one that runs step 3 (global_step then 4)
    assert [calls for step, calls in spy.seen] == [
        [],
        [],
        ["start"],
        ["start", "stop"],
        ["start", "stop"],
        ["start", "stop"],
    ]
    other = MockProfiler()
    _trainer([NsysCapture(start_step=1, stop_step=2, ranks=(1,), profiler=other)]).fit(Tiny(), _loader())
    assert other.calls == []  # rank 0 is not among the chosen ranks
    # the fit ends before stop_step: the range is closed anyway
    late = MockProfiler()
    _trainer([NsysCapture(start_step=4, stop_step=100, profiler=late)]).fit(Tiny(), _loader())
    assert late.calls == ["start", "stop"]


def test_nsys_capture_bad_input():
    from lightning_accel.callbacks.nsys_capture import NsysCapture

    with pytest.raises(ValueError, match="stop_step=3"):
        NsysCapture(start_step=3, stop_step=3)
    with pytest.raises(ValueError, match="start_step=-1"):
        NsysCapture(start_step=-1)
    with pytest.raises(ValueError, match="ranks='0'"):
        NsysCapture(ranks="0")


def test_nvtx_unavailable_names_the_install_on_a_cpu_torch_without_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    monkeypatch.setattr(torch.version, "cuda", None)
    why = nvtx_module.nvtx_unavailable()
    assert why is not None and "pip install nvtx" in why and "CUDA build of torch" in why
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert nvtx_module.nvtx_unavailable() is None


def test_doctor_and_autopilot_with_nvtx_but_no_support_warn_once_and_train(monkeypatch):
    import sys
    import warnings

    from lightning_accel.callbacks.autopilot import Autopilot
    from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

    monkeypatch.setitem(sys.modules, "nvtx", None)
    monkeypatch.setattr(torch.version, "cuda", None)  # as on a CPU-only build, whatever this test runs on
    doctor = BottleneckDoctor(
        nvtx=True,
        window=2,
        warmup_batches=1,
        report_path=False,
        print_report=False,
        utilisation=False,
        smells=False,
        warn=False,
    )
    autopilot = Autopilot(nvtx=True, budget_seconds=0.0, save_plan=False, print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer([autopilot, doctor], steps=8)
        trainer.fit(Tiny(), _loader())
    nvtx_warnings = [str(w.message) for w in caught if "NVTX" in str(w.message)]
    assert len([m for m in nvtx_warnings if m.startswith("BottleneckDoctor(nvtx=True)")]) == 1, nvtx_warnings
    assert len([m for m in nvtx_warnings if m.startswith("Autopilot(nvtx=True)")]) == 1, nvtx_warnings
    assert all("pip install nvtx" in m for m in nvtx_warnings)
    assert trainer.global_step == 8 and doctor.report is not None and doctor.report.batches > 0
