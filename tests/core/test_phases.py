"""The whole fit: phases with a fake clock, and the validation / checkpoint findings with concrete settings."""

import pytest

from lightning_accel.core.phases import FIT_PHASES, FitBreakdown, FitClock, diagnose_fit, phase_cadences
from lightning_accel.core.rules import RunContext
from tests.helpers import FakeClock as Clock


def test_the_innermost_phase_gets_the_time():
    clock = Clock()
    fit = FitClock(clock)
    fit.start()
    fit.enter("startup")
    clock.t = 1.0
    fit.enter("validation", sanity=True)
    clock.t = 1.5
    fit.exit("validation")
    clock.t = 3.0
    fit.exit("startup")
    clock.t = 13.0  # 10 s of training
    fit.enter("validation")
    clock.t = 15.0
    fit.enter("checkpoint")  # saved at the end of validation
    clock.t = 16.0
    fit.exit("checkpoint")
    fit.exit("validation")
    clock.t = 17.0
    fit.stop()
    out = fit.breakdown(train_seconds=9.5, train_batches=100)
    assert out.wall == 17.0 and set(out.seconds) == set(FIT_PHASES)
    assert out.seconds == pytest.approx(
        {"startup": 2.5, "train": 9.5, "validation": 2.5, "checkpoint": 1.0, "other": 1.5}
    )
    assert out.counts == {"validation": 1, "sanity_check": 1, "checkpoint": 1} and out.sanity_seconds == 0.5
    assert FitBreakdown.from_dict(out.to_dict()) == out
    with pytest.raises(ValueError, match="startup"):
        fit.enter("train")


def fit_with(validation=0.0, checkpoint=0.0, counts=None):
    seconds = {"startup": 5.0, "train": 10.0, "validation": validation, "checkpoint": checkpoint, "other": 0.0}
    return FitBreakdown(seconds=seconds, wall=sum(seconds.values()), counts=counts or {}, train_batches=200)


def test_validation_heavy_fit_names_the_interval_that_brings_it_to_five_percent():
    fit = fit_with(validation=10.0, counts={"validation": 20})
    ctx = RunContext(val_check_interval=10, check_val_every_n_epoch=None, limit_val_batches=1.0)
    [finding] = diagnose_fit(fit, ctx).findings
    assert finding.rule == "validation_heavy" and finding.kind == "fit" and finding.value == pytest.approx(0.5)
    assert "20 run(s) of 0.50 s, one every 10 training batches" in finding.evidence
    # 10 s of validation against 10 s of training: 19x less validation gives ~5 %
    assert "Trainer(val_check_interval=190)" in finding.fix and "limit_val_batches=0.053" in finding.fix
    epochs = diagnose_fit(fit, RunContext(val_check_interval=1.0, check_val_every_n_epoch=1)).findings[0]
    assert "check_val_every_n_epoch=19" in epochs.fix


def test_checkpoint_heavy_fit_suggests_the_cadence_and_async_io():
    fit = fit_with(checkpoint=5.0, counts={"checkpoint": 100})
    [finding] = diagnose_fit(fit, RunContext(checkpoint_every_n_train_steps=2, async_checkpoint=False)).findings
    assert finding.rule == "checkpoint_heavy" and finding.stage == "checkpoint"
    assert "100 save(s) of 50 ms, every 2 training step(s)" in finding.evidence
    assert "ModelCheckpoint(every_n_train_steps=50)" in finding.fix and "AsyncCheckpointIO" in finding.fix
    async_fix = diagnose_fit(fit, RunContext(checkpoint_every_n_train_steps=2, async_checkpoint=True)).findings[0]
    assert "AsyncCheckpointIO" not in async_fix.fix


def test_a_light_fit_has_no_finding():
    assert diagnose_fit(fit_with(validation=0.5, checkpoint=0.2)).findings == []
    assert diagnose_fit(FitBreakdown()).findings == []


def test_a_phase_with_a_tail_in_the_training_batches_is_judged_with_it():
    # 2 s of validation (10 % of the 20 s fit after start-up, under the 20 % threshold) plus 3 s of slow training
    # batches right after each run: 25 %, one finding whose saving is both
    fit = fit_with(validation=2.0, counts={"validation": 20})
    fit.seconds["train"], fit.wall = 18.0, 25.0
    ctx = RunContext(val_check_interval=10)
    assert diagnose_fit(fit, ctx).findings == []
    [finding] = diagnose_fit(fit, ctx, tails={"validation": (3.0, 19)}).findings
    assert finding.value == pytest.approx(0.25) and finding.saving == pytest.approx(0.25)
    assert "20 run(s) of 0.10 s" in finding.evidence  # the runs themselves
    assert "3.00 s of it are the 19 training batch(es) that ran slow right after a validation run" in finding.evidence
    assert "persistent_workers=True" in finding.fix
    fit = fit_with(checkpoint=1.0, counts={"checkpoint": 10})
    [finding] = diagnose_fit(fit, RunContext(), tails={"checkpoint": (1.5, 10)}).findings
    assert finding.saving == pytest.approx(2.5 / 11) and "10 save(s) of 100 ms" in finding.evidence
    with pytest.raises(ValueError, match="tails\\['train'\\]"):
        diagnose_fit(fit, RunContext(), tails={"train": (1.0, 1)})


def test_phase_cadences_from_the_settings_else_from_the_fit():
    ctx = RunContext(
        log_every_n_steps=50, checkpoint_every_n_train_steps=20, val_check_interval=100, accumulate_grad_batches=4
    )
    # step counts are optimizer steps: 4 batches each; an int val_check_interval counts batches
    assert phase_cadences(ctx) == {"logging": 200, "checkpoint": 80, "validation": 100}
    measured = fit_with(counts={"validation": 4, "checkpoint": 10})  # 200 training batches
    assert phase_cadences(RunContext(val_check_interval=0.25), measured) == {"checkpoint": 20, "validation": 50}
    assert phase_cadences(RunContext(), fit_with(counts={"validation": 1})) == {}  # one run has no cadence
