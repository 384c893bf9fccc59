"""The one rank-agreement helper (``gather_outcomes``) and its two users: the tuners' ``agree_across_ranks`` (raises)
and the Autopilot backend's ``agree`` (returns the outcome and the failure text). A second rank is scripted by
standing in for the one collective, ``gather_floats``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_accel.callbacks._fit import trainer_state as _trainer
from lightning_accel.callbacks._fit.trainer_state import agree_across_ranks, gather_outcomes

TRAINER = SimpleNamespace(world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu")))


@pytest.fixture
def other_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set ``other_rank.row`` to what rank 1 sends; this process is rank 0."""
    script = SimpleNamespace(row=[0.0, 0.0], what=None)

    def gather(trainer: Any, device: torch.device, values: list[float], what: str = "") -> torch.Tensor:
        script.what = what
        return torch.tensor([values, script.row], dtype=torch.float64)

    monkeypatch.setattr(_trainer, "gather_floats", gather)
    return script


def test_gather_outcomes_returns_every_value_and_the_failed_ranks(other_rank: Any) -> None:
    other_rank.row = [7.0, 1.0]
    values, failed = gather_outcomes(TRAINER, 3.0, None, "what")  # type: ignore[arg-type]
    assert values.tolist() == [3.0, 7.0] and failed == [1] and other_rank.what == "what"
    values, failed = gather_outcomes(TRAINER, 3.0, ValueError("x"), "what")  # type: ignore[arg-type]
    assert failed == [0, 1]


def test_agree_across_ranks_raises_the_own_error_first_then_names_the_failed_ranks(other_rank: Any) -> None:
    other_rank.row = [5.0, 0.0]
    assert agree_across_ranks(TRAINER, 4.0, None, "Tuner search").tolist() == [4.0, 5.0]  # type: ignore[arg-type]
    other_rank.row = [float("nan"), 1.0]
    own = KeyError("mine")
    with pytest.raises(KeyError) as info:
        agree_across_ranks(TRAINER, float("nan"), own, "Tuner search")  # type: ignore[arg-type]
    assert info.value is own
    with pytest.raises(RuntimeError, match=r"^Tuner search: failed on rank\(s\) \[1\]; see their error$"):
        agree_across_ranks(TRAINER, 4.0, None, "Tuner search")  # type: ignore[arg-type]


def test_the_autopilot_backends_agree_keeps_its_messages(other_rank: Any) -> None:
    from lightning_accel.callbacks.autopilot.backend import LightningSearchBackend

    backend = object.__new__(LightningSearchBackend)
    backend.run = SimpleNamespace(trainer=TRAINER)
    other_rank.row = [1.0, 0.0]
    assert backend.agree(True, None) == (True, None)
    assert other_rank.what == "Autopilot trial outcome"
    assert backend.agree(False, None) == (False, None)
    other_rank.row = [0.0, 0.0]
    assert backend.agree(True, None) == (False, None)  # every rank must be ok
    other_rank.row = [0.0, 1.0]
    assert backend.agree(True, None) == (False, "failed on rank(s) [1]")
    assert backend.agree(False, ValueError("boom\nmore")) == (False, "ValueError: boom")
