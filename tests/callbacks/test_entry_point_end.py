"""Under Lightning's own multi-process strategies the last of our callbacks and data modules on the Trainer completes
the outstanding collectives at the end of each entry point (finish_collectives_at_teardown), once, and not under a
strategy of ours, which did it already."""

from __future__ import annotations

import inspect
import types
from unittest import mock

import pytest
from lightning.pytorch.callbacks import Callback, LearningRateMonitor

import lightning_accel
from lightning_accel.strategies import outstanding_work
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork

#: constructor arguments for the callbacks that need some
_ARGS: dict[str, dict[str, object]] = {"ActivationCheckpointing": {"modules": ["layer"]}}


def _public_callbacks() -> list[type[Callback]]:
    classes = [getattr(lightning_accel, name) for name in lightning_accel.__all__]
    return [c for c in classes if inspect.isclass(c) and issubclass(c, Callback)]


def _trainer(
    callbacks: list[Callback], *, world_size: int = 2, strategy: object | None = None, datamodule: object = None
) -> object:
    return types.SimpleNamespace(
        world_size=world_size, strategy=strategy or object(), callbacks=callbacks, datamodule=datamodule
    )


def _teardown_all(trainer: object) -> int:
    """Lightning's order: the data module's ``teardown``, then each callback's."""
    with mock.patch.object(outstanding_work, "finish_outstanding_work") as finish:
        if trainer.datamodule is not None:  # type: ignore[attr-defined]
            trainer.datamodule.trainer = trainer  # type: ignore[attr-defined]
            trainer.datamodule.teardown("fit")  # type: ignore[attr-defined]
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            callback.teardown(trainer, mock.MagicMock(), "fit")  # type: ignore[arg-type]
    return finish.call_count


def test_the_collection_has_callbacks_to_check():
    assert len(_public_callbacks()) >= 10  # a broken discovery would make the test below pass vacuously


@pytest.mark.parametrize("cls", _public_callbacks(), ids=lambda c: c.__name__)
def test_every_callback_of_ours_finishes_the_collectives_when_it_is_the_last_of_ours(cls):
    callback = cls(**_ARGS.get(cls.__name__, {}))
    assert _teardown_all(_trainer([LearningRateMonitor(), callback])) == 1


def test_only_the_last_of_ours_runs_the_barriers_so_every_rank_runs_them_once():
    ours = [lightning_accel.MFUMonitor(), lightning_accel.DevicePrefetcher(), lightning_accel.NonFiniteGuard()]
    assert _teardown_all(_trainer([ours[0], LearningRateMonitor(), *ours[1:]])) == 1


def test_a_subclass_of_one_of_ours_counts_as_ours():
    class MyMonitor(lightning_accel.MFUMonitor):
        pass

    first, last = lightning_accel.DevicePrefetcher(), MyMonitor()
    with mock.patch.object(outstanding_work, "finish_outstanding_work") as finish:
        first.teardown(_trainer([first, last]), mock.MagicMock(), "fit")  # type: ignore[arg-type]
        assert finish.call_count == 0  # not the last of ours
        last.teardown(_trainer([first, last]), mock.MagicMock(), "fit")  # type: ignore[arg-type]
        assert finish.call_count == 1


def test_a_data_module_of_ours_runs_the_barriers_when_no_callback_of_ours_follows(tmp_path):
    datamodule = lightning_accel.MemmapDataModule(train=tmp_path)
    assert _teardown_all(_trainer([LearningRateMonitor()], datamodule=datamodule)) == 1
    # with a callback of ours after it, only the callback runs them
    assert _teardown_all(_trainer([lightning_accel.MFUMonitor()], datamodule=datamodule)) == 1


def test_not_under_a_strategy_of_ours_which_finished_in_its_own_teardown():
    class OurStrategy(FinishesOutstandingWork):
        pass

    assert _teardown_all(_trainer([lightning_accel.DevicePrefetcher()], strategy=OurStrategy())) == 0


def test_not_in_a_single_process_run():
    assert _teardown_all(_trainer([lightning_accel.DevicePrefetcher()], world_size=1)) == 0
