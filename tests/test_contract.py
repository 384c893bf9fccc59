"""The contract every callback and plugin of the collection keeps (Composer runs one over every callback):

* it fits with 0 and with 1 training step, and with ``fast_dev_run``;
* its state survives a checkpoint: what it saved is what a resumed run's fresh instance holds;
* a callback that only measures (or restores what it touched) does not change the loss of the run, step for step;
* under 2-process DDP all of them fit together (one combined run, on a loader passed straight to ``fit()``).

Each component is built small enough for a CPU fit in about a second (``tests/helpers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_accel as la
from tests.helpers import TinyRegressor, cpu_trainer


class _NullProfiler:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class Component:
    """How to build one component for a tiny CPU fit, and what it promises."""

    build: Callable[[Path], Any]
    measures_only: bool  # the run's losses are bit-identical with and without it
    plugin: bool = False
    #: the model of the checkpoint test, chosen so the component's saved state differs from a fresh one's
    checkpoint_model: Callable[[], TinyRegressor] = TinyRegressor
    stateless: bool = False  # keeps no state across a checkpoint (state_dict() is {})


COMPONENTS: dict[str, Component] = {
    "MFUMonitor": Component(
        lambda tmp: la.MFUMonitor(window=2, warmup_batches=0, peak_flops=1e12, print_summary=False),
        measures_only=True,
        stateless=True,
    ),
    "BottleneckDoctor": Component(
        lambda tmp: la.BottleneckDoctor(window=2, warmup_batches=0, report_path=False, print_report=False, warn=False),
        measures_only=True,
        stateless=True,
    ),
    "NonFiniteGuard": Component(
        lambda tmp: la.NonFiniteGuard(), measures_only=True, checkpoint_model=lambda: TinyRegressor(nan_at_batch=0)
    ),
    # a recording stand-in for torch.cuda.profiler (the callback only starts and stops it)
    "NsysCapture": Component(
        lambda tmp: la.NsysCapture(start_step=0, stop_step=1, profiler=_NullProfiler()),
        measures_only=True,
        stateless=True,
    ),
    "DevicePrefetcher": Component(lambda tmp: la.DevicePrefetcher(), measures_only=True, stateless=True),
    "ProfileWindow": Component(
        lambda tmp: la.ProfileWindow(dirpath=tmp / "traces", at_step=0, wait=0, warmup=0, active=1), measures_only=True
    ),
    # the tuner's trials restore parameters, optimizer and RNG; with one worker count it keeps the setting
    "DataLoaderTuner": Component(
        lambda tmp: la.DataLoaderTuner(
            num_workers=(0,),
            prefetch_factors=(2,),
            batches_per_trial=2,
            trial_warmup_batches=0,
            consumption_steps=2,
            print_summary=False,
        ),
        measures_only=True,
        stateless=True,
    ),
    "BatchSizeTuner": Component(
        lambda tmp: la.BatchSizeTuner(memory_budget=64 * 2**30, max_batch_size=8, print_summary=False),
        measures_only=False,
    ),
    "TorchCompile": Component(
        lambda tmp: la.TorchCompile(backend="eager", warmup_batches=0), measures_only=False, stateless=True
    ),
    "ActivationCheckpointing": Component(
        lambda tmp: la.ActivationCheckpointing(modules=["net.0"], measure=False), measures_only=False, stateless=True
    ),
    "Autopilot": Component(
        lambda tmp: la.Autopilot(save_plan=tmp / "plan.json", print_summary=False), measures_only=False
    ),
    "AutoMixedPrecision": Component(lambda tmp: la.AutoMixedPrecision(dtype="bf16"), measures_only=False, plugin=True),
    "OrderedAsyncCheckpointIO": Component(
        lambda tmp: la.OrderedAsyncCheckpointIO(), measures_only=True, plugin=True, stateless=True
    ),
}


def test_the_suite_covers_every_exported_callback_and_plugin():
    import lightning_accel.callbacks as callbacks

    exported = set(callbacks.__all__) | {"AutoMixedPrecision", "OrderedAsyncCheckpointIO"}
    assert exported == set(COMPONENTS)


def _fit(
    name: str, tmp_path: Path, model: pl.LightningModule | None = None, **trainer_kwargs: Any
) -> tuple[pl.Trainer, Any, TinyRegressor]:
    component = COMPONENTS[name]
    built = component.build(tmp_path)
    extra = trainer_kwargs.pop("callbacks", [])
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    trainer = cpu_trainer(
        [*extra] if component.plugin else [built, *extra],
        plugins=[built] if component.plugin else None,
        **trainer_kwargs,
    )
    model = model if model is not None else TinyRegressor()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, built, model


def _state(trainer: pl.Trainer, built: Any, plugin: bool) -> Any:
    if plugin:  # a precision plugin keeps its state in the checkpoint; a CheckpointIO plugin keeps none
        return trainer.precision_plugin.state_dict() if hasattr(built, "state_dict") else {}
    return built.state_dict()


@pytest.mark.parametrize("steps", [0, 1])
@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_fits_with_zero_and_one_step(name, steps, tmp_path):
    _, _, model = _fit(name, tmp_path, max_steps=steps)
    assert len(model.losses) == steps


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_fits_with_fast_dev_run(name, tmp_path):
    _, _, model = _fit(name, tmp_path, fast_dev_run=True, max_steps=-1)
    assert len(model.losses) == 1


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_its_state_survives_a_checkpoint(name, tmp_path):
    component = COMPONENTS[name]
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer, built, _ = _fit(
        name, tmp_path, component.checkpoint_model(), max_steps=2, enable_checkpointing=True, callbacks=[ckpt]
    )
    saved = _state(trainer, built, component.plugin)
    fresh = getattr(component.build(tmp_path), "state_dict", dict)()
    if component.stateless:
        assert saved == fresh == {}
    else:  # the run left state a fresh instance lacks: the resumed instance below must have loaded it
        assert saved != fresh
    stored = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    if not component.plugin and saved:
        assert stored["callbacks"][built.state_key] == saved
    # a fresh instance resumed from the checkpoint (max_steps reached: no further step) holds what was saved
    resumed_ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt2", save_last=True)
    trainer2, built2, model2 = _fit(
        name,
        tmp_path,
        max_steps=2,
        enable_checkpointing=True,
        callbacks=[resumed_ckpt],
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert trainer2.global_step == 2 and model2.losses == []
    assert _state(trainer2, built2, component.plugin) == saved


@pytest.mark.parametrize("name", sorted(n for n, c in COMPONENTS.items() if c.measures_only))
def test_a_callback_that_only_measures_does_not_change_the_loss(name, tmp_path):
    pl.seed_everything(7)
    plain = TinyRegressor(dropout=0.2)  # every step reads the global RNG: a callback may not draw from it
    cpu_trainer(max_steps=6).fit(plain)
    pl.seed_everything(7)
    _, _, measured = _fit(name, tmp_path, TinyRegressor(dropout=0.2), max_steps=6)
    assert measured.seen == plain.seen  # the same samples in the same order
    assert measured.losses == plain.losses and len(plain.losses) == 6
    for a, b in zip(measured.parameters(), plain.parameters()):
        assert torch.equal(a, b)


@pytest.mark.distributed
def test_every_component_fits_under_two_process_ddp(ddp_script, tmp_path):
    ddp_script(
        f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from pathlib import Path
        import lightning.pytorch as pl
        from tests.helpers import TinyRegressor
        from tests.test_contract import COMPONENTS

        tmp = Path.cwd()
        callbacks = [c.build(tmp) for c in COMPONENTS.values() if not c.plugin]
        plugins = [c.build(tmp) for c in COMPONENTS.values() if c.plugin]
        model = TinyRegressor()
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks, plugins=plugins)
        # the loader passed straight to fit(): the tuners re-create it, Lightning shards the re-created one
        trainer.fit(model, model.train_dataloader())
        tuner = next(c for c in callbacks if type(c).__name__ == "BatchSizeTuner")
        json.dump({{"steps": trainer.global_step, "losses": len(model.losses),
                   "sampler": type(trainer.train_dataloader.sampler).__name__,
                   "batch_size": trainer.train_dataloader.batch_size, "chosen": tuner.summary["batch_size"],
                   "first": model.seen[:1]}}, open(f"contract_rank{{trainer.global_rank}}.json", "w"))
    """,
        timeout=400,
    )
    from tests.conftest import read_rank_json

    ranks = read_rank_json(tmp_path, "contract")
    for rank in ranks:
        assert {k: rank[k] for k in ("steps", "losses", "sampler")} == {
            "steps": 3,
            "losses": 3,
            "sampler": "DistributedSampler",
        }
        assert rank["batch_size"] == rank["chosen"] == ranks[0]["chosen"]  # the ranks adopted one size
    assert ranks[0]["first"] != ranks[1]["first"]  # each rank trains on its own shard
