"""What the Autopilot shows while it searches: the phases and each trial's row, in order, on a terminal (a rich live
line) and in a log (plain lines); silent with ``print_summary=False``; never inside a measured window."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch

from lightning_accel.callbacks.autopilot import Autopilot
from lightning_accel.callbacks.autopilot.fixes import Intervention
from tests.callbacks.test_autopilot import FAST, Model, _loader


class Faster(Intervention):
    name, kind = "faster", "exact"

    def change(self, run, undo) -> None:
        run.extras["faster"] = True
        undo.push(lambda: run.extras.pop("faster"))


class Slower(Intervention):
    name, kind = "slower", "exact"

    def change(self, run, undo) -> None:
        run.extras["slower"] = True
        undo.push(lambda: run.extras.pop("slower"))


@pytest.fixture
def measured(monkeypatch):
    """Scripted rates (``faster`` 1.5x, ``slower`` 0.8x) and a flag that is set while a window is being timed."""
    from lightning_accel.callbacks.autopilot import backend as _autopilot_backend
    from lightning_accel.callbacks.autopilot import windows as _autopilot_trials

    inside = {"now": False, "printed_inside": 0}
    real_measure = _autopilot_trials.TrialRunner.measure

    def timed(self, *args, **kwargs):
        inside["now"] = True
        try:
            return real_measure(self, *args, **kwargs)
        finally:
            inside["now"] = False

    monkeypatch.setattr(_autopilot_trials.TrialRunner, "measure", timed)
    real = _autopilot_backend.LightningSearchBackend.measure

    def measure(self, warmup_steps, steps):
        window = real(self, warmup_steps, steps)
        extras = self.run.extras
        scale = (
            window.samples
            / (100.0 * (1.3 if "faster" in extras else 1.0) * (0.8 if "slower" in extras else 1.0))
            / window.seconds
        )
        window.seconds *= scale
        window.stage_seconds = {k: v * scale for k, v in window.stage_seconds.items()}
        return window

    monkeypatch.setattr(_autopilot_backend.LightningSearchBackend, "measure", measure)
    from lightning_accel.callbacks.autopilot import display as _autopilot_display

    for name in ("phase", "record"):
        original = getattr(_autopilot_display.SearchDisplay, name)

        def wrapped(self, arg, _original=original):
            inside["printed_inside"] += inside["now"]
            return _original(self, arg)

        monkeypatch.setattr(_autopilot_display.SearchDisplay, name, wrapped)
    return inside


def _fit(autopilot, progress_bar: bool) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        callbacks=[autopilot],
    )
    trainer.fit(Model(sleep_s=0.0), _loader(sleep_s=0.0))


def _positions(out: str, needles: list[str]) -> list[int]:
    found = []
    for needle in needles:
        index = out.find(needle, found[-1] + 1 if found else 0)
        assert index >= 0, f"{needle!r} not found (in order) in:\n{out}"
        found.append(index)
    return found


ORDER = [
    "Autopilot | baseline",
    "Autopilot trial 0: baseline (as configured)",
    "Autopilot | trial 1 of <= 3: faster, measuring",
    "Autopilot | trial 1 of <= 3: faster, numerics probe",
    "Autopilot | trial 1 of <= 3: faster, confirmation (A B B A)",
    "Autopilot trial 1: faster |",
    "best 1.30x",
    "trial 2 of <= 3: slower, numerics probe",
    "Autopilot trial 2: slower |",
]


def test_plain_lines_when_not_a_terminal_show_the_phases_and_rows_in_order(measured, capsys) -> None:
    autopilot = Autopilot(**FAST, only=[], interventions=[Faster(), Slower()], save_plan=False)
    _fit(autopilot, progress_bar=False)
    out = capsys.readouterr().out
    _positions(out, ORDER)
    assert "\x1b[" not in out  # no terminal control codes in a log
    row = re.search(r"Autopilot trial 1: faster \| ([\d,.]+) samples/s \| 1.30x baseline \| kept \| paired", out)
    assert row, out
    table = out.index("Autopilot (rank 0)")  # the final table comes after the live rows
    assert table > out.index("Autopilot trial 2: slower |")
    assert measured["printed_inside"] == 0


def test_a_terminal_gets_a_live_line_and_the_rows_above_it(measured, capsys, monkeypatch) -> None:
    monkeypatch.setattr("lightning_accel.callbacks.autopilot.callback._is_terminal", lambda: True)
    autopilot = Autopilot(**FAST, only=[], interventions=[Faster(), Slower()], save_plan=False)
    _fit(autopilot, progress_bar=True)
    out = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", capsys.readouterr().out)
    _positions(
        out,
        [
            "Autopilot | baseline",
            "Autopilot trial 0: baseline",
            "faster, numerics probe",
            "Autopilot trial 1: faster |",
            "slower, numerics probe",
            "Autopilot trial 2: slower |",
        ],
    )
    assert measured["printed_inside"] == 0


def test_quiet_with_print_summary_false(measured, capsys) -> None:
    autopilot = Autopilot(**FAST, only=[], interventions=[Faster()], save_plan=False, print_summary=False)
    _fit(autopilot, progress_bar=False)
    out = capsys.readouterr().out
    assert "Autopilot |" not in out and "Autopilot trial" not in out
    assert autopilot.kept and autopilot.kept[0].name == "faster"
    assert torch.is_grad_enabled()
