"""DataLoaderTuner on CPU: a sleeping dataset makes workers win clearly (sleep needs no CPU, so the test holds on a
loaded 2-core machine); a slow step makes the cheapest setting win; the sample sequence is unchanged."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner, default_worker_counts
from tests.helpers import SleepyDataset as Sleepy


class Model(pl.LightningModule):
    def __init__(self, sleep_s: float = 0.006, step_sleep_s: float = 0.0, n: int = 256) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.prefetch_factor, self.persistent_workers = 4, 0, None, False
        self.sleep_s, self.step_sleep_s, self.n = sleep_s, step_sleep_s, n
        self.layer = nn.Linear(8, 1)
        self.order = torch.Generator().manual_seed(1234)  # kept on the module: the tuner must not advance it
        self.seen: list[int] = []
        self.workers_seen: set[int] = set()

    def training_step(self, batch, batch_idx):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        x, _ = batch
        return self.layer(x).square().mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.extend(batch[1].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        workers = self.num_workers
        return DataLoader(
            Sleepy(self.n, self.sleep_s),
            batch_size=self.batch_size,
            shuffle=True,
            generator=self.order,
            num_workers=workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=self.persistent_workers and workers > 0,
        )


def _trainer(callbacks, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=kwargs.pop("max_steps", 6),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


def test_slow_dataset_chooses_workers_and_keeps_the_sample_order() -> None:
    pl.seed_everything(0)
    plain = Model()
    _trainer([]).fit(plain)

    pl.seed_everything(0)
    tuned = Model()
    tuner = DataLoaderTuner(num_workers=(0, 2), prefetch_factors=(2,), batches_per_trial=8, print_summary=False)
    _trainer([tuner]).fit(tuned)

    assert tuned.num_workers == 2 and tuner.decision["num_workers"] == 2
    assert tuned.prefetch_factor == 2 and tuned.persistent_workers is True
    rates = {row["setting"]: row["batches_per_sec"] for row in tuner.table}
    assert rates["2 workers, prefetch 2"] > 1.4 * rates["0 workers (main process)"]
    assert tuner.decision["fed"] is False  # a tiny step outruns a sleeping dataset: the table says data-bound
    assert tuned.seen == plain.seen and len(plain.seen) == 6 * 4
    for a, b in zip(tuned.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_slow_step_keeps_the_cheapest_setting() -> None:
    model = Model(sleep_s=0.0, step_sleep_s=0.03)
    model.num_workers = 2  # the user over-provisioned: 0 workers already feed a 30 ms step
    tuner = DataLoaderTuner(num_workers=(0, 1, 2), batches_per_trial=8, print_summary=False)
    _trainer([tuner], max_steps=2).fit(model)
    assert model.num_workers == 0 and model.prefetch_factor is None and model.persistent_workers is False
    assert tuner.decision["fed"] is True
    assert tuner.decision["step_batches_per_sec"] < 40  # 1 / 30 ms
    assert [r["setting"] for r in tuner.table] == ["initial: 2 workers, prefetch 2", "0 workers (main process)"]


def test_missing_attribute_names_where_it_looked() -> None:
    class NoWorkers(Model):
        def __init__(self):
            super().__init__()
            del self.num_workers

        def train_dataloader(self):
            return DataLoader(Sleepy(16, 0), batch_size=4)

    with pytest.raises(ValueError, match=r"no `workers` attribute in the LightningModule, its hparams"):
        _trainer([DataLoaderTuner(num_workers_attr="workers")]).fit(NoWorkers())


def test_loader_that_ignores_the_attribute_is_reported() -> None:
    class Ignores(Model):
        def train_dataloader(self):
            return DataLoader(Sleepy(256, 0), batch_size=4)

    with pytest.raises(ValueError, match="build it from that attribute"):
        _trainer([DataLoaderTuner(num_workers=(1,), print_summary=False)]).fit(Ignores())


def test_grid_pins_memory_only_on_gpu() -> None:
    from types import SimpleNamespace

    tuner = DataLoaderTuner(num_workers=(0, 2), prefetch_factors=(2, 4))
    present = {"num_workers": True, "prefetch_factor": True, "persistent_workers": True, "pin_memory": True}
    for device, pinned in (("cuda", True), ("cpu", False)):
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), num_devices=1)
        grid = tuner._grid(trainer, present)
        assert [(g.num_workers, g.prefetch_factor, g.persistent_workers) for g in grid] == [
            (0, None, False),
            (2, 2, True),
            (2, 4, True),
        ]
        assert all(g.pin_memory is pinned for g in grid)
    no_prefetch = tuner._grid(trainer, {**present, "prefetch_factor": False})
    assert [(g.num_workers, g.prefetch_factor) for g in no_prefetch] == [(0, None), (2, None)]


def test_grid_and_arguments() -> None:
    assert default_worker_counts(1) == [0, 1]
    assert default_worker_counts(2) == [0, 1, 2]
    assert default_worker_counts(6) == [0, 1, 2, 4, 6]
    for kwargs in (
        dict(num_workers=(-1,)),
        dict(prefetch_factors=(0,)),
        dict(margin=-0.1),
        dict(batches_per_trial=1),
        dict(consumption_steps=1),
    ):
        with pytest.raises(ValueError, match="DataLoaderTuner"):
            DataLoaderTuner(**kwargs)


def test_a_loader_too_short_to_time_keeps_its_settings_with_a_warning():
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accel import DataLoaderTuner

    class Tiny(pl.LightningModule):
        num_workers = 0

        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(20, 4)), batch_size=4, num_workers=self.num_workers)

    tuner = DataLoaderTuner(print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tuner],
    )
    model = Tiny()
    with pytest.warns(UserWarning, match="the train loader has 5 batches"):
        trainer.fit(model)
    assert trainer.global_step == 3 and model.num_workers == 0
    assert "skipped" in tuner.decision


def test_a_loader_passed_to_fit_is_tuned_and_the_fit_trains_on_the_choice() -> None:
    """No attributes at all: the DataLoader given to ``trainer.fit`` is re-created with each setting (as the Autopilot
    does), the fit runs on the chosen one, and the sample order is the user's own."""

    class Plain(Model):
        train_dataloader = None  # type: ignore[assignment]

        def __init__(self) -> None:
            super().__init__()
            del self.num_workers, self.prefetch_factor, self.persistent_workers

        def on_train_start(self) -> None:
            self.workers_seen.add(self.trainer.train_dataloader.num_workers)

    def loader(model: Model) -> DataLoader:
        return DataLoader(Sleepy(256, 0.006), batch_size=4, shuffle=True, generator=model.order)

    pl.seed_everything(0)
    plain = Plain()
    _trainer([]).fit(plain, loader(plain))

    pl.seed_everything(0)
    tuned = Plain()
    users = loader(tuned)
    tuner = DataLoaderTuner(num_workers=(0, 2), prefetch_factors=(2,), batches_per_trial=8, print_summary=False)
    _trainer([tuner]).fit(tuned, users)

    assert tuner.decision["num_workers"] == 2 and tuner.decision["initial"]["num_workers"] == 0
    assert tuned.workers_seen == {2} and plain.workers_seen == {0}
    assert users.num_workers == 0  # the user's object is left as it was; the fit trains on a re-created one
    assert tuned.seen == plain.seen and len(plain.seen) == 6 * 4
