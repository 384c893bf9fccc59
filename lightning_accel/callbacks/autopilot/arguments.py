"""The Autopilot's arguments checked before any training: each bad value is refused naming it and the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_accel._checks import check_int
from lightning_accel.callbacks.autopilot.fixes import INTERVENTIONS, Intervention, knob_names
from lightning_accel.core.autopilot import DEFAULT_TOLERANCES, NUMERICS_KINDS, Tolerance

__all__ = ["check_numbers", "fix_names", "own_fixes", "tolerances_by_kind"]


def check_numbers(
    *, budget: float, budget_seconds: float | None, threshold: float, steps: Mapping[str, tuple[int, int]]
) -> None:
    """``budget`` in (0, 1], ``budget_seconds`` >= 0, ``threshold`` in [0, 1); ``steps``: name → (value, least)."""
    if not (isinstance(budget, (int, float)) and 0 < budget <= 1):
        raise ValueError(f"Autopilot(budget={budget!r}): give the search's share of the fit in (0, 1], e.g. 0.05")
    if budget_seconds is not None and not (isinstance(budget_seconds, (int, float)) and budget_seconds >= 0):
        raise ValueError(f"Autopilot(budget_seconds={budget_seconds!r}): give seconds >= 0, e.g. 60")
    if not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
        raise ValueError(f"Autopilot(threshold={threshold!r}): give a relative gain in [0, 1), e.g. 0.05")
    for name, (value, least) in steps.items():
        check_int("Autopilot", name, value, minimum=least)


def fix_names(freeze: str | Sequence[str], only: str | Sequence[str] | None) -> tuple[list[str], list[str] | None]:
    """``freeze`` (fix names or knobs) and ``only`` (built-in fix names) as lists, every name known."""
    frozen = [freeze] if isinstance(freeze, str) else list(freeze)
    unknown = sorted(set(frozen) - (set(INTERVENTIONS) | set(knob_names())))
    if unknown:
        raise ValueError(
            f"Autopilot(freeze={frozen!r}): {unknown} unknown; freeze fix names {sorted(INTERVENTIONS)} "
            f"or settings {knob_names()}"
        )
    if only is None:
        return frozen, None
    chosen = [only] if isinstance(only, str) else list(only)
    bad = sorted(set(chosen) - set(INTERVENTIONS))
    if bad:
        raise ValueError(f"Autopilot(only={chosen!r}): {bad} unknown; fixes are {sorted(INTERVENTIONS)}")
    return frozen, chosen


def own_fixes(interventions: Sequence[Intervention]) -> list[Intervention]:
    """The user's fixes, each an :class:`Intervention` with a name and a known numerics kind."""
    for extra in interventions:
        if not isinstance(extra, Intervention) or not extra.name:
            raise ValueError(f"Autopilot(interventions=...): {extra!r} is not an Intervention with a `name`")
        if extra.kind not in NUMERICS_KINDS:
            raise ValueError(
                f"Autopilot(interventions=...): {type(extra).__name__}.kind={extra.kind!r}; kinds "
                f"are {list(NUMERICS_KINDS)}"
            )
    return list(interventions)


def tolerances_by_kind(tolerances: Mapping[str, Tolerance] | None) -> dict[str, Tolerance]:
    """The default tolerances with the user's replacing theirs."""
    out = dict(DEFAULT_TOLERANCES)
    for kind, tol in (tolerances or {}).items():
        if kind not in NUMERICS_KINDS or not isinstance(tol, Tolerance):
            raise ValueError(
                f"Autopilot(tolerances={{{kind!r}: {tol!r}}}): keys are {list(NUMERICS_KINDS)}, "
                "values Tolerance(max_loss_rel, min_grad_cosine, min_update_cosine)"
            )
        out[kind] = tol
    return out
