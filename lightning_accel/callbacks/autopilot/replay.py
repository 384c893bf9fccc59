"""A plan replayed without searching (``Autopilot(plan=...)``, or the plan a resumed fit's checkpoint holds): each
kept change applied again, in order, where it still applies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.callbacks.autopilot.backend import short_error
from lightning_accel.callbacks.autopilot.fit_run import run_identity
from lightning_accel.callbacks.autopilot.fixes import INTERVENTIONS, Intervention, Run
from lightning_accel.core.autopilot import AutopilotPlan, Outcome, TrialRecord, plan_misfit

__all__ = ["replay"]


def replay(
    run: Run,
    plan: AutopilotPlan,
    *,
    own: Sequence[Intervention],
    frozen: Callable[[Intervention], bool],
    plan_path: Path | None,
    first_index: int = 0,
) -> tuple[AutopilotPlan, list[TrialRecord], list[Intervention]]:
    """Apply ``plan``'s kept changes to ``run``: the plan to report (the search's numbers, stopped "replayed ..."),
    a row per entry and the fixes applied. A plan read from ``plan_path`` that was made for another model, device
    type, device count or global batch is refused (``ValueError``) before anything is changed. ``own``: the user's fixes (``interventions=``) a plan may name; ``frozen``:
    whether the user froze a fix. An entry that is frozen, does not apply or raises is skipped with a warning."""
    identity = run_identity(run)
    if plan_path is not None:  # a plan from a file may come from another job; a checkpoint's is this job's own
        why = plan_misfit(plan, **identity)
        if why is not None:
            raise ValueError(
                f"Autopilot(plan={str(plan_path)!r}) was not made for this run: {why}. Search this run instead "
                "(Autopilot() without plan=, or `lightning-accel run --autopilot`)"
            )
    replayed = AutopilotPlan(
        model=type(run.module).__name__,
        **identity,
        stopped=f"replayed {plan_path or 'the checkpoint'}",
        baseline_samples_per_sec=plan.baseline_samples_per_sec,
        final_samples_per_sec=plan.final_samples_per_sec,
        speedup=plan.speedup,
        speedup_low=plan.speedup_low,
        speedup_high=plan.speedup_high,
        speedup_source=plan.speedup_source,
        noise=plan.noise,
        trials=plan.trials,
    )
    if plan.fingerprint is None and plan.model and plan.model != type(run.module).__name__:
        rank_zero_warn(
            f"Autopilot: the plan was made for {plan.model}, this run trains "
            f"{type(run.module).__name__}; replaying it anyway"
        )
    by_name = {e.name: e for e in own}
    records: list[TrialRecord] = []
    kept: list[Intervention] = []
    for entry in plan.kept:
        name, params = entry["name"], dict(entry.get("params", {}))
        if name in INTERVENTIONS:
            fix = INTERVENTIONS[name](**params)
        elif name in by_name:
            fix = by_name[name]
            fix.params = params
        else:
            raise ValueError(
                f"Autopilot(plan={str(plan_path)!r}): unknown change {name!r}; built-in changes "
                f"are {sorted(INTERVENTIONS)} (pass your own with interventions=[...])"
            )
        record = TrialRecord(
            first_index + len(records),
            name,
            fix.describe(run),
            entry.get("samples_per_sec"),
            None,
            False,
            "replayed from the plan",
            outcome=Outcome.REPLAYED,
        )
        records.append(record)
        if frozen(fix):
            record.reason = "not replayed: frozen by Autopilot(freeze=...)"
            continue
        why = fix.unavailable(run)
        if why is not None:
            record.reason = f"not replayed: {why}"
            rank_zero_warn(f"Autopilot: plan entry {name} does not apply to this run ({why}); skipped")
            continue
        try:
            fix.apply(run)
        except Exception as err:  # noqa: BLE001
            record.reason = f"not replayed: {type(err).__name__}: {short_error(err)}"
            try:
                fix.revert(run)
            except Exception:  # noqa: BLE001
                pass
            rank_zero_warn(f"Autopilot: replaying {name} failed ({err!r}); skipped")
            continue
        record.kept = True
        record.change = fix.describe(run)
        kept.append(fix)
    run.runner.state.restore()
    return replayed, records, kept
