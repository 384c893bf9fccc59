"""The one integer-argument check: bools refused, the minimum and None handled, the message names the fix."""

from __future__ import annotations

import pytest

from lightning_accel._checks import check_int, is_int


def test_accepts_integers_at_and_above_the_minimum_and_returns_them():
    assert check_int("X", "n", 3) == 3
    assert check_int("X", "n", 0, minimum=0) == 0
    assert check_int("X", "n", None, optional=True) is None
    assert is_int(5) and not is_int(True) and not is_int(2.0)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "3", None])
def test_refuses_everything_else_naming_owner_argument_value_and_fix(value):
    with pytest.raises(ValueError) as info:
        check_int("MFUMonitor", "window", value, unit="batches", example=20)
    assert str(info.value) == f"MFUMonitor(window={value!r}): use an integer >= 1 (batches), e.g. window=20"


def test_optional_and_command_line_wording():
    with pytest.raises(ValueError, match=r"^find_batch_size\(max_batch_size=0\): use an integer >= 1 or None$"):
        check_int("find_batch_size", "max_batch_size", 0, optional=True)
    with pytest.raises(ValueError, match=r"^demo: --batch-size must be an integer >= 1, got 0$"):
        check_int("demo", "batch_size", 0, flag=True)
