"""DevicePrefetcher in real Lightning fits: same batches, samplers' epochs, restored strategy, no leaked threads, DDP."""

from __future__ import annotations

import dataclasses
import threading
import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_accel import DevicePrefetcher
from lightning_accel.core.prefetch import PrefetchingLoader


@dataclasses.dataclass
class Item:
    x: torch.Tensor
    tag: str


class Samples(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "idx": i, "item": Item(torch.tensor([i]), f"t{i}")}


def collate(samples):
    return {
        "x": torch.stack([s["x"] for s in samples]),
        "idx": [s["idx"] for s in samples],
        "item": Item(torch.cat([s["item"].x for s in samples]), ",".join(s["item"].tag for s in samples)),
    }


class EpochRecordingSampler(RandomSampler):
    def __init__(self, data):
        super().__init__(data, generator=torch.Generator().manual_seed(0))
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)
        self.generator.manual_seed(epoch)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen, self.val_loaders, self.train_loaders = [], [], []
        self.sampler = EpochRecordingSampler(Samples())

    def training_step(self, batch, batch_idx):
        assert isinstance(batch["item"], Item) and isinstance(batch["item"].tag, str)
        self.seen.append((batch["idx"], batch["item"].tag, batch["x"].clone()))
        return self.layer(batch["x"]).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def on_train_epoch_start(self):
        self.train_loaders.append(self.trainer.train_dataloader)
        self.val_loaders.append(self.trainer.val_dataloaders)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=4, sampler=self.sampler, collate_fn=collate)

    def val_dataloader(self):
        return DataLoader(Samples(), batch_size=8, collate_fn=collate)


def fit(callbacks, model_class=None, **kwargs):
    torch.manual_seed(0)
    model = (model_class or Model)()
    args = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        limit_val_batches=1,
    )
    args.update(kwargs)
    trainer = pl.Trainer(callbacks=callbacks, **args)
    trainer.fit(model)
    return trainer, model


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "lightning-accel-prefetch" and t.is_alive()]


def test_same_batches_in_same_order_and_sampler_epochs():
    _, plain = fit([])
    prefetcher = DevicePrefetcher(depth=3)
    trainer, model = fit([prefetcher])
    assert len(model.seen) == len(plain.seen) == 12
    for (idx_a, tag_a, x_a), (idx_b, tag_b, x_b) in zip(plain.seen, model.seen):
        assert idx_a == idx_b and tag_a == tag_b and torch.equal(x_a, x_b)
    assert model.sampler.epochs == plain.sampler.epochs == [0, 1]  # set_epoch reached the wrapped loader's sampler
    assert plain.seen[0][0] != plain.seen[6][0]  # epochs really differ, so the check above has teeth
    # only the train loader was wrapped; val is untouched by default
    assert len(prefetcher.wrapped_loaders) == 1
    assert isinstance(model.train_loaders[0], PrefetchingLoader) and model.train_loaders[0].batch_size == 4
    assert isinstance(model.val_loaders[0], DataLoader)
    # the strategy's method is the class's again, and no thread survives fit
    assert "process_dataloader" not in vars(trainer.strategy)
    assert not prefetch_threads()


def test_a_seeded_shuffled_loader_gives_every_epoch_the_order_it_gives_without_the_prefetcher():
    # The common reproducible setup: DataLoader(shuffle=True, generator=...). Lightning stops each epoch at the
    # loader's length; a prefetcher that read past it would draw the next permutation from that generator.
    class Plain(Model):
        def train_dataloader(self):
            return DataLoader(
                Samples(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5), collate_fn=collate
            )

    def seen(callbacks):
        _, model = fit(callbacks, Plain, max_epochs=3, limit_val_batches=0, num_sanity_val_steps=0)
        return [idx for idx, _, _ in model.seen]

    plain = seen([])
    assert seen([DevicePrefetcher(depth=4)]) == plain
    assert plain[6] != plain[0] and plain[12] != plain[6]  # each epoch's order differs: the check has teeth


def test_stopping_mid_epoch_leaves_no_thread_and_val_opt_in():
    prefetcher = DevicePrefetcher(loaders=("train", "val"))
    trainer, model = fit([prefetcher], max_epochs=1, max_steps=2)
    assert len(model.seen) == 2
    assert isinstance(model.val_loaders[0], PrefetchingLoader)
    deadline = time.monotonic() + 5
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not prefetch_threads()


def test_epochs_cut_short_by_limit_train_batches_leave_no_thread():
    # Lightning abandons each epoch's iterator without exhausting it; the threads must still all end
    trainer, model = fit([DevicePrefetcher()], max_epochs=3, limit_train_batches=2, num_sanity_val_steps=0)
    assert len(model.seen) == 6
    assert not prefetch_threads()


def test_loader_error_surfaces_from_fit():
    class Broken(Samples):
        def __getitem__(self, i):
            if i == 9:
                raise ValueError("corrupt sample 9")
            return super().__getitem__(i)

    class M(Model):
        def train_dataloader(self):
            return DataLoader(Broken(), batch_size=4, collate_fn=collate)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[DevicePrefetcher()],
    )
    with pytest.raises(ValueError, match="corrupt sample 9"):
        trainer.fit(M())
    assert not prefetch_threads()


def test_existing_instance_patch_is_restored():
    prefetcher = DevicePrefetcher()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[prefetcher],
    )
    calls = []

    def theirs(dl):
        calls.append(dl)
        return dl

    trainer.strategy.process_dataloader = theirs
    trainer.fit(Model())
    assert len(calls) == 1 and vars(trainer.strategy)["process_dataloader"] is theirs


def test_demo_flags_add_the_callbacks():
    from lightning_accel.demo.run import DemoConfig, build_callbacks

    names = [type(cb).__name__ for cb in build_callbacks(DemoConfig(prefetch=True, profile_at_step=5))]
    assert names == ["MFUMonitor", "DevicePrefetcher", "ProfileWindow", "BottleneckDoctor"]
    assert [type(cb).__name__ for cb in build_callbacks(DemoConfig())] == ["MFUMonitor", "BottleneckDoctor"]
    with pytest.raises(ValueError, match="--profile-at-step must be"):
        DemoConfig(profile_at_step=-1).validate()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"depth": 0}, r"depth=0\): use an integer >= 1 \(batches\), e.g. depth=2"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"loaders": ("train", "eval")}, "choose one or more of"),
        ({"loaders": ()}, "choose one or more of"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DevicePrefetcher(**kwargs)


@pytest.mark.distributed
def test_ddp_each_rank_sees_the_same_samples_with_and_without(ddp_script, tmp_path):
    ddp_script("""
        import json
        import lightning.pytorch as pl
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from lightning_accel import DevicePrefetcher

        class M(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(1, 1)
                self.seen = []
            def training_step(self, batch, batch_idx):
                self.seen.append(batch[0].flatten().tolist())
                return self.layer(batch[0]).sum()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.arange(32.0).unsqueeze(1)), batch_size=4, shuffle=True)

        def run(callbacks):
            model = M()
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, callbacks=callbacks)
            trainer.fit(model)
            return trainer, model

        _, plain = run([])
        trainer, wrapped = run([DevicePrefetcher()])
        with open(f"seen_rank{trainer.global_rank}.json", "w") as f:
            json.dump({"plain": plain.seen, "prefetched": wrapped.seen}, f)
    """)
    from tests.conftest import read_rank_json

    r0, r1 = read_rank_json(tmp_path, "seen")
    for rank in (r0, r1):
        assert rank["plain"] == rank["prefetched"] and len(rank["plain"]) == 8  # 2 epochs x 16 samples / 4
    flat = lambda seen: sorted(v for batch in seen for v in batch)  # noqa: E731
    # the DistributedSampler split the data: each epoch the ranks' samples are disjoint and cover everything
    assert flat(r0["prefetched"][:4] + r1["prefetched"][:4]) == [float(i) for i in range(32)]
    assert r0["prefetched"][:4] != r0["prefetched"][4:]  # set_epoch reshuffled epoch 2
