"""BatchSizeTuner on CPU: fake-OOM modules, a real RAM budget, state restore, accumulation and LR rules, DDP."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

from lightning_accel.callbacks.batch_size_tuner import BatchSizeTuner
from lightning_accel.core.batch_size_search import BatchSizeSearchError
from tests.helpers import IndexedDataset as Indexed

GiB = 2**30


class Net(pl.LightningModule):
    """Tiny regression model with a ``batch_size`` attribute; ``oom_above`` fakes CUDA OOMs above that size."""

    def __init__(
        self,
        batch_size: int = 4,
        oom_above: int | None = None,
        n: int = 512,
        fail_above: int | None = None,
        lr: float = 0.01,
        activation_kb: int = 0,
        norm: bool = True,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.oom_above, self.fail_above, self.lr, self.n, self.activation_kb = (
            oom_above,
            fail_above,
            lr,
            n,
            activation_kb,
        )
        self.net = nn.Sequential(
            nn.Linear(16, 32),
            nn.BatchNorm1d(32) if norm else nn.Identity(),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(32, 1),
        )
        self.seen: list[int] = []
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        b = len(x)
        if self.oom_above is not None and b > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} MiB")
        if self.fail_above is not None and b > self.fail_above:
            raise ValueError(f"user bug at batch {b}")
        out = self.net(x)
        loss = nn.functional.mse_loss(out, y)
        if self.activation_kb:  # a per-sample activation the RSS measurement can see: activation_kb KiB per sample
            wide = out.expand(b, self.activation_kb * 256).contiguous() * 1.0001
            loss = loss + 1e-9 * wide.square().mean()
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):  # the fit loop's batches only: probes never get here
        self.seen.extend(batch[2].tolist())
        self.sizes.append(len(batch[2]))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1000)}

    def train_dataloader(self):
        return DataLoader(Indexed(self.n), batch_size=self.batch_size, shuffle=True)


def _trainer(callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


BIG = 64 * GiB  # an explicit budget far above what the tiny model uses: only the fake OOM limits the search


def test_fake_oom_module_finds_the_limit_in_few_probes() -> None:
    pl.seed_everything(0)
    model = Net(oom_above=200)
    tuner = BatchSizeTuner(memory_budget=BIG, print_summary=False)
    _trainer([tuner]).fit(model)
    result = tuner.result
    assert 0.9 * 200 <= model.batch_size <= 200
    assert model.sizes[:2] == [model.batch_size] * 2  # training ran at the tuned size; probes were not recorded
    assert all(p.batch_size <= 200 for p in result.probes if p.outcome == "ok")
    assert result.num_probes <= 10
    assert tuner.summary["batch_size"] == model.batch_size


class SimulatedDevice:
    """Memory meter of a fake device: the step reports ``fixed + per_sample × batch`` and OOMs above capacity."""

    def __init__(self, fixed: float, per_sample: float, capacity: float) -> None:
        self.fixed, self.per_sample, self.capacity, self.peak = fixed, per_sample, capacity, 0.0

    def step(self, b: int) -> None:
        peak = self.fixed + self.per_sample * b
        if peak > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.peak = max(self.peak, peak)

    def reset(self) -> None:
        self.peak = 0.0

    def peak_bytes(self) -> float:
        return self.peak


def test_linear_memory_device_reaches_95_percent_in_at_most_6_probes() -> None:
    device = SimulatedDevice(fixed=6 * GiB, per_sample=40 * 2**20, capacity=24 * GiB)

    class OnDevice(Net):
        def training_step(self, batch, batch_idx):
            device.step(len(batch[0]))
            return super().training_step(batch, batch_idx)

    model = OnDevice(n=1024)
    tuner = BatchSizeTuner(memory_budget=int(0.9 * 24 * GiB), memory_meter=device, print_summary=False)
    _trainer([tuner], max_steps=1).fit(model)
    true_max = int((0.9 * 24 * GiB - 6 * GiB) // (40 * 2**20))
    assert tuner.result.num_probes <= 6
    assert 0.95 * true_max <= model.batch_size <= true_max
    assert tuner.result.model.bytes_per_sample == pytest.approx(40 * 2**20)
    assert tuner.summary["memory_source"] == "SimulatedDevice"


def test_state_is_bit_identical_and_training_equals_an_untuned_run_at_that_size(tmp_path) -> None:
    pl.seed_everything(0)
    tuned = Net(oom_above=100)
    before = copy.deepcopy(tuned.state_dict())
    tuner = BatchSizeTuner(memory_budget=BIG, print_summary=False)

    class Check(pl.Callback):
        def on_fit_start(self, trainer, pl_module):  # runs right after the tuner (callbacks run in order)
            for k, v in pl_module.state_dict().items():
                assert torch.equal(v, before[k]), k
            assert trainer.optimizers[0].state == {} or len(trainer.optimizers[0].state) == 0
            assert trainer.global_step == 0
            assert trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer_steps == 0
            assert pl_module.training  # the probes' train() was undone: Lightning puts it in train mode itself
            self.rng = torch.get_rng_state()

    check = Check()
    rng_before = None

    class Rng(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            nonlocal rng_before
            rng_before = torch.get_rng_state()

    _trainer([Rng(), tuner, check], max_steps=4, default_root_dir=tmp_path).fit(tuned)
    assert torch.equal(rng_before, check.rng)
    assert list(tmp_path.iterdir()) == []  # no checkpoint or temporary file was written
    size = tuned.batch_size

    pl.seed_everything(0)
    plain = Net(batch_size=size, oom_above=100)
    _trainer([], max_steps=4).fit(plain)
    assert plain.seen == tuned.seen
    for (k, a), b in zip(tuned.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k


def test_restore_after_steps_with_optimizer_state_is_exact() -> None:
    from lightning_accel.callbacks._fit.step_runner import StepRunner, TrainingState

    pl.seed_everything(0)
    model = Net()
    trainer = _trainer([], max_steps=5)
    trainer.fit(model)  # optimizer state exists now
    opt = trainer.optimizers[0]
    params = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    rng = torch.get_rng_state()
    state = TrainingState(trainer, model)
    runner = StepRunner(trainer, model)
    with runner.quiet():
        for _ in range(3):
            runner.step((torch.randn(8, 16), torch.randn(8, 1), torch.arange(8)))
    assert not torch.equal(model.net[0].weight, params["net.0.weight"])
    state.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    after = opt.state_dict()
    assert after["param_groups"] == opt_state["param_groups"]
    for pid, s in opt_state["state"].items():
        for key, v in s.items():
            assert torch.equal(after["state"][pid][key], v), (pid, key)
    assert torch.equal(torch.get_rng_state(), rng)
    assert "log" not in model.__dict__


def test_non_oom_failure_is_reraised_unchanged_after_restore() -> None:
    pl.seed_everything(0)
    model = Net(fail_above=20)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="user bug at batch") as info:
        _trainer([BatchSizeTuner(memory_budget=BIG, print_summary=False)]).fit(model)
    assert type(info.value) is ValueError
    assert model.batch_size == 4  # the attribute is back to the user's value
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_missing_attribute_names_where_it_looked() -> None:
    class NoBatch(Net):
        def __init__(self):
            super().__init__()
            del self.batch_size

        def train_dataloader(self):
            return DataLoader(Indexed(64), batch_size=4)

    with pytest.raises(ValueError, match=r"no `bs` attribute in the LightningModule, its hparams"):
        _trainer([BatchSizeTuner(batch_arg_name="bs")]).fit(NoBatch())


def test_budget_smaller_than_one_sample() -> None:
    with pytest.raises(BatchSizeSearchError, match="smaller than one sample"):
        _trainer([BatchSizeTuner(memory_budget=1024, print_summary=False)]).fit(Net(norm=False))


def test_dataset_smaller_than_the_batch_is_clamped_with_a_warning() -> None:
    model = Net(n=24)
    with pytest.warns(UserWarning, match="only 24 samples per rank"):
        _trainer([BatchSizeTuner(memory_budget=BIG, print_summary=False)], max_steps=2).fit(model)
    assert model.batch_size == 24


def test_dataloader_that_ignores_the_attribute_is_reported() -> None:
    class Fixed(Net):
        def train_dataloader(self):
            return DataLoader(Indexed(256), batch_size=4)

    with pytest.raises(ValueError, match="must build its DataLoader from that attribute"):
        _trainer([BatchSizeTuner(memory_budget=BIG, print_summary=False)]).fit(Fixed())


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[dict, int]] = []

    name, version = "memory", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        self.metrics.append((dict(metrics), step))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_target_global_batch_sets_accumulation_and_keeps_lr() -> None:
    model = Net(batch_size=96, oom_above=64, lr=0.01)
    tuner = BatchSizeTuner(memory_budget=BIG, target_global_batch_size=96, lr_scaling="linear", print_summary=False)
    logger = MemoryLogger()
    trainer = _trainer([tuner], max_steps=2, logger=logger)
    trainer.fit(model)
    assert (model.batch_size, trainer.accumulate_grad_batches) == (48, 2)
    assert set(model.sizes) == {48}
    assert len(model.sizes) == 4  # 2 optimizer steps × 2 micro-batches
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01)  # global batch unchanged: same lr
    assert tuner.summary["global_batch_size"] == 96
    tuned = next(m for m, step in logger.metrics if "tuner/batch_size" in m)
    assert tuned["tuner/batch_size"] == 48 and tuned["tuner/accumulate_grad_batches"] == 2
    assert tuned["tuner/global_batch_size"] == 96 and tuned["tuner/lr_scale"] == 1.0
    assert tuned["tuner/probes"] == tuner.result.num_probes and tuned["tuner/memory_budget_gb"] == BIG / 1e9


@pytest.mark.parametrize(("rule", "scale"), [("linear", 16.0), ("sqrt", 4.0), ("none", 1.0)])
def test_lr_scaling_when_the_effective_batch_changes(rule: str, scale: float, caplog) -> None:
    model = Net(batch_size=4, lr=0.01)
    tuner = BatchSizeTuner(memory_budget=BIG, max_batch_size=64, lr_scaling=rule, print_summary=False)
    trainer = _trainer([tuner], max_steps=1)
    trainer.fit(model)
    assert model.batch_size == 64
    group = trainer.optimizers[0].param_groups[0]
    assert group["lr"] == pytest.approx(0.01 * scale)
    assert group["initial_lr"] == pytest.approx(0.01 * scale)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(0.01 * scale)]
    assert tuner.summary["lr_scale"] == pytest.approx(scale)
    said = "lr 0.01 -> " + f"{0.01 * scale:.6g}" + f" ({rule} rule, effective batch 4 -> 64)"
    assert (said in caplog.text) == (rule != "none")


def test_cpu_ram_budget_is_measured_not_guessed() -> None:
    """Real process-RSS probes: a 256 KiB/sample activation under a budget 48 MiB above the current RSS."""
    import psutil

    from lightning_accel.core.memory_probe import PeakMemoryMeter

    if not PeakMemoryMeter("cpu").exact:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    pl.seed_everything(0)
    model = Net(activation_kb=256, n=4096)
    budget = psutil.Process().memory_info().rss + 48 * 2**20
    tuner = BatchSizeTuner(memory_budget=budget, print_summary=False, init_batch_size=8)
    _trainer([tuner], max_steps=1).fit(model)
    result = tuner.result
    chosen = next(p for p in result.probes if p.batch_size == model.batch_size)
    assert chosen.outcome == "ok" and chosen.peak_bytes <= budget
    # the activation plus its copies (expand/contiguous, mul, square) cost >= 256 KiB per sample
    assert result.model is not None and 256 * 2**10 <= result.model.bytes_per_sample <= 8 * 2**20
    assert 8 <= model.batch_size <= 48 * 2**20 / (256 * 2**10)


def test_throughput_mode_on_cpu() -> None:
    model = Net(n=1024)
    tuner = BatchSizeTuner(
        mode="throughput", memory_budget=BIG, max_batch_size=512, throughput_threshold=0.05, print_summary=False
    )
    _trainer([tuner], max_steps=1).fit(model)
    probes = tuner.result.probes
    assert all(p.seconds_per_step is not None and p.seconds_per_step > 0 for p in probes)
    sizes = [p.batch_size for p in probes]
    assert sizes == sorted(sizes) and sizes[0] == 2 and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert model.batch_size in sizes
    # every doubling up to the chosen size paid off by the threshold
    rates = {p.batch_size: p.samples_per_sec for p in probes}
    b = model.batch_size
    while b > 2:
        assert rates[b] >= 1.05 * rates[b // 2]
        b //= 2


def test_retune_at_a_later_epoch_rebuilds_the_dataloader() -> None:
    model = Net(batch_size=4, n=64, oom_above=16)
    tuner = BatchSizeTuner(memory_budget=BIG, epochs=(1,), print_summary=False)
    _trainer([tuner], max_steps=-1, max_epochs=2).fit(model)
    assert model.sizes[:16] == [4] * 16  # epoch 0 untouched
    assert set(model.sizes[16:]) == {16} and len(model.sizes) == 16 + 4


def test_bad_arguments() -> None:
    for kwargs in (
        dict(mode="fast"),
        dict(memory_fraction=1.5),
        dict(lr_scaling="cubic"),
        dict(epochs=(-1,)),
        dict(max_probes=1),
        dict(init_batch_size=0),
        dict(memory_budget=-5),
    ):
        with pytest.raises(ValueError, match="BatchSizeTuner"):
            BatchSizeTuner(**kwargs)


def test_state_dict_round_trip_reapplies_without_search() -> None:
    model = Net(oom_above=40)
    tuner = BatchSizeTuner(memory_budget=BIG, print_summary=False)
    _trainer([tuner], max_steps=1).fit(model)
    saved = tuner.state_dict()
    assert saved == {"batch_size": model.batch_size, "accumulate_grad_batches": 1}
    resumed = BatchSizeTuner(memory_budget=BIG, print_summary=False)
    resumed.load_state_dict(saved)
    fresh = Net(oom_above=40)
    _trainer([resumed], max_steps=1).fit(fresh)
    assert fresh.batch_size == model.batch_size and resumed.result is None


@pytest.mark.distributed
def test_ddp_ranks_with_different_memory_limits_adopt_the_minimum(ddp_script, tmp_path) -> None:
    ddp_script(f"""
        import json, os, sys
        sys.path.insert(0, {str(tmp_path.parent)!r})
        import lightning.pytorch as pl
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from lightning_accel import BatchSizeTuner

        class M(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.batch_size = 4
                self.layer = nn.Linear(8, 1)
                self.sizes = []
            def training_step(self, batch, _):
                x, = batch
                # each rank runs out of memory above its own limit: rank 0 at 48, rank 1 at 24
                if len(x) > (48 if self.global_rank == 0 else 24):
                    raise torch.OutOfMemoryError("CUDA out of memory")
                return self.layer(x).square().mean()
            def on_train_batch_end(self, outputs, batch, batch_idx):
                self.sizes.append(len(batch[0]))
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn(512, 8)), batch_size=self.batch_size)

        tuner = BatchSizeTuner(memory_budget=64 * 2**30, target_global_batch_size=96, print_summary=False)
        model = M()
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                             callbacks=[tuner], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model)
        out = dict(rank=trainer.global_rank, batch_size=model.batch_size, sizes=model.sizes,
                   accum=trainer.accumulate_grad_batches, per_rank=tuner.summary["per_rank"],
                   own=tuner.result.batch_size)
        json.dump(out, open(f"bst_rank{{trainer.global_rank}}.json", "w"))
    """)
    from tests.conftest import read_rank_json

    ranks = read_rank_json(tmp_path, "bst")
    own = [r["own"] for r in ranks]
    assert own[1] <= 24 < own[0] <= 48  # each rank found its own limit
    for r in ranks:
        assert r["per_rank"] == own
        # 96 global = micro × 2 devices × accumulation, micro <= min(own)
        assert r["batch_size"] * 2 * r["accum"] == 96 and r["batch_size"] <= min(own)
        assert set(r["sizes"]) == {r["batch_size"]}
    assert ranks[0]["batch_size"] == ranks[1]["batch_size"]


# ---------------------------------------------------------------------------------------------------------------
# a DataLoader passed straight to trainer.fit(model, loader): re-created at each size, as the Autopilot does
# ---------------------------------------------------------------------------------------------------------------


class NoLoaderNet(Net):
    """The commonest script shape: no ``train_dataloader()``, no ``batch_size`` attribute."""

    train_dataloader = None  # type: ignore[assignment]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        del self.batch_size


def test_a_loader_passed_to_fit_is_tuned_and_the_fit_trains_on_the_chosen_size() -> None:
    model = NoLoaderNet(oom_above=40)
    loader = DataLoader(Indexed(512), batch_size=4, shuffle=True)
    tuner = BatchSizeTuner(memory_budget=BIG, print_summary=False)
    trainer = _trainer([tuner], max_steps=2)
    trainer.fit(model, loader)
    assert 32 <= tuner.summary["batch_size"] <= 40 and tuner.summary["previous_batch_size"] == 4
    assert model.sizes == [tuner.summary["batch_size"]] * 2  # the fit's own batches, not only the probes'
    assert loader.batch_size == 4  # the user's loader object is left as it was
    assert trainer.train_dataloader.batch_size == tuner.summary["batch_size"]


def test_a_fit_loader_resumed_from_the_tuned_state_reapplies_without_search() -> None:
    tuner = BatchSizeTuner(memory_budget=BIG, print_summary=False)
    tuner.load_state_dict({"batch_size": 8, "accumulate_grad_batches": 1})
    model = NoLoaderNet()
    _trainer([tuner], max_steps=2).fit(model, DataLoader(Indexed(64), batch_size=4))
    assert model.sizes == [8, 8] and tuner.result is None


def test_a_fit_loader_with_a_custom_batch_sampler_is_refused_before_any_work() -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    class Pairs(BatchSampler):
        pass

    loader = DataLoader(Indexed(64), batch_sampler=Pairs(SequentialSampler(range(64)), 2, False))
    model = NoLoaderNet()
    with pytest.raises(
        ValueError,
        match=r"BatchSizeTuner: the DataLoader passed to trainer.fit cannot be re-created "
        r"with another batch size: the loader batches with a custom Pairs",
    ):
        _trainer([BatchSizeTuner(memory_budget=BIG, print_summary=False)]).fit(model, loader)
    assert model.sizes == []
