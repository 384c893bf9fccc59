"""Attaching without editing the script: the ``LIGHTNING_ACCEL`` variable read by the callbacks factory Lightning
calls on every ``Trainer(...)`` (lightning_accel/attach.py). Scripts run as processes are in
tests/commands/test_run_command.py."""

from __future__ import annotations

import importlib.util
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import lightning.pytorch as pl
import pytest

import lightning_accel as la
from lightning_accel import attach
from lightning_accel.attach import ENV_VAR, AttachSpec, parse_spec
from tests.helpers.models import TinyRegressor

HAS_PLOTS = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(autouse=True)
def _fresh_warnings():
    attach._warn_once.cache_clear()
    yield
    attach._warn_once.cache_clear()


def _trainer(**kwargs):
    kwargs = {
        "accelerator": "cpu",
        "max_steps": 30,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        **kwargs,
    }
    return pl.Trainer(**kwargs)


def _ours(trainer):
    return [type(c).__name__ for c in trainer.callbacks if type(c).__module__.startswith("lightning_accel")]


def test_both_namespaces_register_the_factory():
    for group, function in (
        ("lightning.pytorch.callbacks_factory", "lightning_callbacks"),
        ("pytorch_lightning.callbacks_factory", "pytorch_lightning_callbacks"),
    ):
        names = {e.name: e.value for e in entry_points(group=group)}
        assert names.get("lightning_accel") == f"lightning_accel_attach:{function}", (group, names)


def test_an_installed_collection_adds_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert _ours(_trainer(logger=False)) == []
    monkeypatch.setenv(ENV_VAR, "  ")
    assert _ours(_trainer(logger=False)) == []


def test_the_variable_attaches_the_measuring_callbacks_through_lightnings_entry_point(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "doctor,mfu")
    assert _ours(_trainer(logger=False)) == ["AttachedRun", "MFUMonitor", "BottleneckDoctor"]


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        ("doctor", AttachSpec(doctor=True)),
        ("MFU , doctor", AttachSpec(doctor=True, mfu=True)),
        ("html", AttachSpec(doctor=True, html=True)),
        ("autopilot,dir:/tmp/r", AttachSpec(autopilot=True, report_dir=Path("/tmp/r"))),
        ("plan:runs/autopilot_plan.json", AttachSpec(plan=Path("runs/autopilot_plan.json"))),
    ],
)
def test_the_accepted_forms(value, spec):
    assert parse_spec(value) == spec
    assert parse_spec(spec.to_value()) == spec


@pytest.mark.parametrize("value", ["docter", "doctor;mfu", "plan:", "autopilot,plan:p.json", "dir"])
def test_a_malformed_value_names_itself_and_the_accepted_forms(value):
    with pytest.raises(ValueError) as err:
        parse_spec(value)
    assert repr(value) in str(err.value)


def test_a_malformed_variable_warns_once_and_the_job_trains_unattached(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, "docter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainers = [_trainer(logger=False, default_root_dir=tmp_path) for _ in range(2)]
        trainers[0].fit(TinyRegressor())
    ours = [w for w in caught if ENV_VAR in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "'docter'" in str(ours[0].message) and "doctor, mfu" in str(ours[0].message)
    assert [_ours(t) for t in trainers] == [[], []]
    assert trainers[0].global_step == 30


def test_a_callback_the_user_passed_wins_with_their_arguments(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, "doctor,mfu")
    theirs = la.BottleneckDoctor(report_path=tmp_path / "mine.json", print_report=False)
    trainer = _trainer(logger=False, callbacks=[theirs])
    doctors = [c for c in trainer.callbacks if isinstance(c, la.BottleneckDoctor)]
    assert doctors == [theirs]
    assert _ours(trainer).count("MFUMonitor") == 1


def test_a_stateful_autopilot_the_user_passed_is_not_doubled(monkeypatch):
    # two Autopilots would be two stateful callbacks of one type: Lightning refuses the Trainer
    monkeypatch.setenv(ENV_VAR, "autopilot")
    theirs = la.Autopilot(print_summary=False)
    trainer = _trainer(logger=False, callbacks=[theirs])
    assert [c for c in trainer.callbacks if isinstance(c, la.Autopilot)] == [theirs]
    assert _ours(trainer) == ["Autopilot"]  # nothing left to attach: not even the run folder


def test_a_callback_added_after_the_trainer_was_built_still_wins(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, "doctor")
    trainer = _trainer(logger=False, default_root_dir=tmp_path)
    attached = next(c for c in trainer.callbacks if isinstance(c, la.BottleneckDoctor))
    theirs = la.BottleneckDoctor(report_path=tmp_path / "mine.json", print_report=False)
    trainer.callbacks.append(theirs)
    trainer.fit(TinyRegressor())
    assert (tmp_path / "mine.json").exists()
    assert attached.report is None  # switched off at setup: it measured nothing
    assert not (tmp_path / attach.DEFAULT_FOLDER).exists()


def test_reports_go_to_the_loggers_folder_or_a_named_one(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, "html")
    trainer = _trainer(default_root_dir=tmp_path)  # Lightning's default CSVLogger
    trainer.fit(TinyRegressor())
    folder = Path(trainer.log_dir)
    assert (folder / "bottleneck_report.json").exists()
    assert (folder / "bottleneck_report.html").exists() == HAS_PLOTS  # the page's plots need matplotlib

    trainer = _trainer(logger=False, default_root_dir=tmp_path / "nolog")
    trainer.fit(TinyRegressor())
    assert (tmp_path / "nolog" / attach.DEFAULT_FOLDER / "bottleneck_report.json").exists()
    assert (tmp_path / "nolog" / attach.DEFAULT_FOLDER / "bottleneck_report.html").exists() == HAS_PLOTS

    monkeypatch.setenv(ENV_VAR, f"doctor,dir:{tmp_path / 'chosen'}")
    trainer = _trainer(default_root_dir=tmp_path)
    trainer.fit(TinyRegressor())
    assert (tmp_path / "chosen" / "bottleneck_report.json").exists()


def test_an_attached_measuring_callback_that_fails_switches_itself_off_and_the_fit_goes_on(monkeypatch, tmp_path):
    calls = []

    def broken(self, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("planted failure")

    monkeypatch.setattr(la.BottleneckDoctor, "on_train_batch_end", broken)
    monkeypatch.setenv(ENV_VAR, "doctor,mfu")
    trainer = _trainer(logger=False, default_root_dir=tmp_path)
    model = TinyRegressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert trainer.global_step == 30 and len(model.losses) == 30
    assert calls == [1]  # switched off after its first failure
    failed = [str(w.message) for w in caught if "planted failure" in str(w.message)]
    assert len(failed) == 1 and "BottleneckDoctor" in failed[0] and "on_train_batch_end" in failed[0]
    mfu = next(c for c in trainer.callbacks if isinstance(c, la.MFUMonitor))
    assert mfu.summary  # the other attached callback went on measuring


def test_a_callback_the_user_passed_is_not_guarded(monkeypatch, tmp_path):
    def broken(self, *args, **kwargs):
        raise RuntimeError("their own callback")

    monkeypatch.setattr(la.BottleneckDoctor, "on_train_batch_end", broken)
    monkeypatch.setenv(ENV_VAR, "mfu")
    trainer = _trainer(logger=False, default_root_dir=tmp_path, callbacks=[la.BottleneckDoctor()])
    with pytest.raises(RuntimeError, match="their own callback"):
        trainer.fit(TinyRegressor())
