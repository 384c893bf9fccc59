"""Fixtures the Autopilot's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def scripted_speed(monkeypatch):
    """Replace the measured rate by ``100 samples/s x speed(run)`` (the windows still run their real steps): the
    keep/revert decision becomes exact, so a test of either branch can fail."""

    def install(speed) -> None:
        from lightning_accel.callbacks.autopilot import backend as _autopilot_backend

        real = _autopilot_backend.LightningSearchBackend.measure

        def measure(self, warmup_steps, steps):
            window = real(self, warmup_steps, steps)
            scale = window.samples / (100.0 * speed(self.run)) / window.seconds
            window.seconds *= scale  # the stage split keeps its proportions
            window.stage_seconds = {k: v * scale for k, v in window.stage_seconds.items()}
            return window

        monkeypatch.setattr(_autopilot_backend.LightningSearchBackend, "measure", measure)

    return install
