"""Autopilot on CPU, planted scenarios: a data-bound run gets workers (also from a DataLoader passed straight to
fit), a compute-bound run keeps its configuration, a small micro-batch grows with the global batch held fixed, the
numerics guard rejects a change of the numbers, a change that raises is reverted, a plan replays, frozen settings
stay, a budget too small changes nothing, Ctrl-C leaves the model as it was; the training after the search is the
run the chosen settings give from the start.

Slow data is a sleeping ``__getitem__`` (needs no CPU, so the gain survives a loaded 2-core machine); slow compute
per call is a sleeping ``training_step`` (a cost per call that a larger micro-batch amortises)."""

from __future__ import annotations

import json
import signal
import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_accel.callbacks.autopilot import Autopilot
from lightning_accel.callbacks.autopilot.fixes import Intervention

FAST = {"warmup_steps": 2, "measure_steps": 8, "budget_seconds": 120.0, "freeze": ["compile"]}


def _prefetch_threads() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name == "lightning-accel-prefetch" and t.is_alive()}


@pytest.fixture(autouse=True)
def _no_prefetch_thread_survives():
    """The Autopilot's prefetch trials (and a kept DevicePrefetcher) must leave no producer thread behind."""
    before = _prefetch_threads()
    yield
    deadline = time.monotonic() + 5
    while _prefetch_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _prefetch_threads() - before


class Sleepy(Dataset):
    def __init__(self, n: int = 192, sleep_s: float = 0.004) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.tensor(float(i))


class Model(pl.LightningModule):
    def __init__(self, step_sleep_s: float = 0.0, batch_size: int = 4, sleep_s: float = 0.004, n: int = 192) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.step_sleep_s, self.batch_size, self.sleep_s, self.n = step_sleep_s, batch_size, sleep_s, n
        self.num_workers = 0
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        x, y = batch
        return (self.layer(x).squeeze(-1) - y / 100).square().mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.extend(int(v) for v in batch[1].tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class AttrModel(Model):
    """Builds its loader in ``train_dataloader()`` from attributes (the tuners' contract)."""

    def train_dataloader(self):
        workers = self.num_workers
        return DataLoader(
            Sleepy(self.n, self.sleep_s),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(7),
            num_workers=workers,
            persistent_workers=workers > 0,
        )


def _trainer(callbacks, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=kwargs.pop("max_steps", 12),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


def _loader(sleep_s: float = 0.004, batch_size: int = 4, num_workers: int = 0) -> DataLoader:
    return DataLoader(
        Sleepy(192, sleep_s),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_data_bound_loader_passed_to_fit_gets_workers_and_trains_as_if_set_from_the_start(tmp_path) -> None:
    model = Model()
    autopilot = Autopilot(**FAST, save_plan=tmp_path / "plan.json")
    trainer = _trainer([autopilot])
    trainer.fit(model, _loader())  # the DataLoader straight to fit(): Lightning's own tuner cannot do this
    assert [r.name for r in autopilot.kept][:1] == ["dataloader"], autopilot.records
    workers = autopilot.kept[0].params["num_workers"]
    assert workers >= 1 and trainer.train_dataloader.num_workers == workers
    dl = next(r for r in autopilot.records if r.name == "dataloader")
    assert dl.kept and dl.vs_baseline > 1.05 and dl.numerics["ok"]
    assert "num_workers=" in autopilot.python and "DataLoader(" in autopilot.python
    # the same fit with the chosen settings from the start: same batches, same final weights
    reference = Model()
    _trainer([]).fit(reference, _loader(num_workers=workers))
    assert model.seen == reference.seen
    for key, value in _weights(reference).items():
        assert torch.equal(value, model.state_dict()[key]), key
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kept"][0]["name"] == "dataloader" and plan["kept"][0]["params"]["num_workers"] == workers
    assert plan["baseline_samples_per_sec"] > 0 and plan["trials"][0]["name"] == "baseline"


def test_replay_applies_the_plan_without_measuring(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "version": 1,
                "kept": [
                    {
                        "name": "dataloader",
                        "params": {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": True},
                    },
                    {"name": "prefetch", "params": {}},
                ],
            }
        )
    )
    autopilot = Autopilot(plan=plan, save_plan=False)
    trainer = _trainer([autopilot], max_steps=3)
    trainer.fit(Model(), _loader())
    assert [r.reason for r in autopilot.records] == ["replayed from the plan"] * 2
    assert all(r.samples_per_sec is None for r in autopilot.records)
    assert trainer.train_dataloader.loader.num_workers == 2  # PrefetchingLoader around the rebuilt DataLoader
    assert "la.DevicePrefetcher()" in autopilot.python


def test_bad_plan_fails_before_training(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        Autopilot(plan=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "kept": [{"name": "warp_drive", "params": {}}]}))
    autopilot = Autopilot(plan=bad)
    model = Model()
    before = _weights(model)
    with pytest.raises(ValueError, match="unknown change 'warp_drive'"):
        _trainer([autopilot]).fit(model, _loader(sleep_s=0.0))
    for key, value in before.items():
        assert torch.equal(value, model.state_dict()[key])


def test_attribute_loader_module_gets_its_attribute_set() -> None:
    model = AttrModel()
    autopilot = Autopilot(**FAST, save_plan=False)
    _trainer([autopilot], max_steps=2).fit(model)
    assert autopilot.kept and autopilot.kept[0].name == "dataloader"
    assert model.num_workers == autopilot.kept[0].params["num_workers"] >= 1
    assert f"model.num_workers = {model.num_workers}" in autopilot.python
    assert f"model:\n  num_workers: {model.num_workers}" in autopilot.yaml


class Noop(Intervention):
    """Changes nothing: measures the same as the current configuration."""

    name, kind = "noop", "exact"

    def apply(self, run) -> None:
        self.applied = True

    def revert(self, run) -> None:
        self.reverted = True


def test_compute_bound_run_keeps_its_configuration(scripted_speed) -> None:
    # every configuration measures the same rate (scripted: the decision is exact; the real windows still run)
    scripted_speed(lambda run: 1.0)
    model = Model(sleep_s=0.0, step_sleep_s=0.002)
    noop = Noop()
    autopilot = Autopilot(**FAST, interventions=[noop], save_plan=False)
    trainer = _trainer([autopilot])
    data = DataLoader(
        TensorDataset(torch.randn(96, 8), torch.arange(96.0)),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )
    trainer.fit(model, data)
    measured = [r for r in autopilot.records[1:] if r.samples_per_sec is not None]
    assert measured and autopilot.kept == []  # candidates were trialled; none was faster
    assert trainer.train_dataloader.num_workers == 0 and not hasattr(trainer.train_dataloader, "loader")
    group = trainer.optimizers[0].param_groups[0]
    assert group["foreach"] is None and group["fused"] is None  # SGD's defaults, as the user wrote it
    assert autopilot.plan.final_samples_per_sec == autopilot.plan.baseline_samples_per_sec


def test_small_micro_batch_grows_with_the_global_batch_fixed() -> None:
    # a per-call cost (4 ms sleep in training_step): a larger micro-batch amortises it
    model = AttrModel(step_sleep_s=0.004, sleep_s=0.0, batch_size=2)
    autopilot = Autopilot(**FAST, only=["micro_batch"], save_plan=False)
    trainer = _trainer([autopilot], max_steps=3, accumulate_grad_batches=8)
    trainer.fit(model)
    kept = [c.params for c in autopilot.kept]
    # the jump to one micro-batch per step (2x8 -> 16x1) in one trial: the sleep is per call, so the largest
    # micro-batch is the fastest
    assert kept == [{"batch_size": 16, "accumulate_grad_batches": 1}], autopilot.records
    assert model.batch_size * trainer.accumulate_grad_batches == 16  # the global batch per device is unchanged
    assert trainer.train_dataloader.batch_size == model.batch_size == kept[-1]["batch_size"]
    record = next(r for r in autopilot.records if r.name == "micro_batch")
    assert record.numerics["ok"] and record.numerics["grad_cosine"] > 0.999
    assert f"trainer:\n  accumulate_grad_batches: {trainer.accumulate_grad_batches}\n" in autopilot.yaml
    assert autopilot.python.count("accumulate_grad_batches") == 1


class ScaleOutput(Intervention):
    """Multiplies the model's output by 1.5: different numbers, which the guard must catch."""

    name, kind = "scale_output", "reorder"

    def apply(self, run) -> None:
        self.handle = run.module.layer.register_forward_hook(lambda m, a, out: out * 1.5)

    def revert(self, run) -> None:
        self.handle.remove()


def test_numerics_guard_rejects_a_change_of_the_numbers() -> None:
    model = Model(sleep_s=0.0)
    change = ScaleOutput()
    autopilot = Autopilot(**FAST, only=[], interventions=[change], save_plan=False)
    _trainer([autopilot], max_steps=2).fit(model, _loader(sleep_s=0.0))
    record = next(r for r in autopilot.records if r.name == "scale_output")
    assert not record.kept and record.reason.startswith("numerics guard: loss differs")
    assert record.numerics["loss_rel_diff"] > 0.1 and record.samples_per_sec is None  # rejected before measuring
    assert not model.layer._forward_hooks  # reverted


class BreaksHalfway(Intervention):
    name, kind = "breaks_halfway", "exact"

    def apply(self, run) -> None:
        run.module.layer.weight.data.mul_(0.0)  # half-applied ...
        raise RuntimeError("backend exploded")

    def revert(self, run) -> None:
        self.reverted = True


class FailsInTheStep(Intervention):
    name, kind = "fails_in_step", "exact"

    def apply(self, run) -> None:
        def boom(module, args):
            if module.training and torch.is_grad_enabled() and getattr(self, "armed", False):
                raise RuntimeError("kernel not found")

        self.handle = run.module.layer.register_forward_pre_hook(boom)
        self.armed = True

    def revert(self, run) -> None:
        self.handle.remove()


def test_a_change_that_raises_is_reverted_and_reported() -> None:
    model = Model(sleep_s=0.0)
    breaks, fails = BreaksHalfway(), FailsInTheStep()
    initial = _weights(model)
    autopilot = Autopilot(**FAST, only=[], interventions=[breaks, fails], save_plan=False)
    trainer = _trainer([autopilot], max_steps=1)
    trainer.fit(model, _loader(sleep_s=0.0))
    rows = {r.name: r for r in autopilot.records}
    assert rows["breaks_halfway"].reason == "could not apply: RuntimeError: backend exploded" and breaks.reverted
    assert "kernel not found" in rows["fails_in_step"].reason and not model.layer._forward_pre_hooks
    assert autopilot.kept == []
    # the half-applied change did not survive: training started from the original weights
    reference = Model(sleep_s=0.0)
    _trainer([], max_steps=1).fit(reference, _loader(sleep_s=0.0))
    for key, value in _weights(reference).items():
        assert torch.equal(value, model.state_dict()[key])
    assert not torch.equal(initial["layer.weight"], model.state_dict()["layer.weight"])  # it did train


class ChangesNothing(Intervention):
    name, kind = "changes_nothing", "exact"

    def apply(self, run) -> None:
        self.applied = True

    def revert(self, run) -> None:
        self.reverted = True

    def changed_nothing(self, run) -> str | None:
        return "no call matched (nothing changed)"


class Sleeps(Intervention):
    """Slows every training step: measured, and not kept."""

    name, kind = "sleeps", "exact"

    def apply(self, run) -> None:
        self.handle = run.module.layer.register_forward_pre_hook(lambda m, a: time.sleep(0.002))

    def revert(self, run) -> None:
        self.handle.remove()


def test_a_void_change_is_rejected_unmeasured_and_does_not_use_up_the_patience() -> None:
    model = Model(sleep_s=0.0)
    void, slow = ChangesNothing(), Sleeps()
    autopilot = Autopilot(**FAST, patience=1, only=[], interventions=[void, slow], save_plan=False)
    _trainer([autopilot], max_steps=1).fit(model, _loader(sleep_s=0.0))
    rows = {r.name: r for r in autopilot.records}
    assert rows["changes_nothing"].reason == "no call matched (nothing changed)" and void.reverted
    assert rows["changes_nothing"].samples_per_sec is None and not rows["changes_nothing"].kept
    # patience=1: the void change did not count as a miss, so the next one was still measured
    assert rows["sleeps"].samples_per_sec is not None and not rows["sleeps"].kept
    assert autopilot.plan.stopped == "1 measured candidate(s) in a row without a gain"
    assert not model.layer._forward_pre_hooks


def test_frozen_settings_are_never_touched() -> None:
    model = Model()
    autopilot = Autopilot(**{**FAST, "freeze": ["compile", "num_workers"]}, save_plan=False)
    trainer = _trainer([autopilot], max_steps=2)
    trainer.fit(model, _loader())
    row = next(r for r in autopilot.records if r.name == "dataloader")
    assert not row.kept and "frozen" in row.reason
    assert trainer.train_dataloader.num_workers == 0
    with pytest.raises(ValueError, match=r"freeze=\['num_wrokers'\]"):
        Autopilot(freeze=["num_wrokers"])


def test_budget_too_small_changes_nothing() -> None:
    model = Model()
    autopilot = Autopilot(**{**FAST, "budget_seconds": 0.0}, save_plan=False)
    trainer = _trainer([autopilot], max_steps=2)
    trainer.fit(model, _loader())
    assert autopilot.kept == [] and any("too small for one trial" in n for n in autopilot.notes)
    assert trainer.train_dataloader.num_workers == 0


class Interrupts(Intervention):
    name, kind = "interrupts", "exact"

    def apply(self, run) -> None:
        run.module.layer.bias.data.add_(100.0)

        def interrupt(module, args):
            if module.training and torch.is_grad_enabled():
                raise KeyboardInterrupt

        self.handle = run.module.layer.register_forward_pre_hook(interrupt)

    def revert(self, run) -> None:
        self.handle.remove()
        run.module.layer.bias.data.sub_(100.0)


def test_ctrl_c_during_a_trial_leaves_the_model_as_it_was() -> None:
    model = Model(sleep_s=0.0)
    before = _weights(model)
    autopilot = Autopilot(**FAST, only=[], interventions=[Interrupts()], save_plan=False)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            _trainer([autopilot], max_steps=2).fit(model, _loader(sleep_s=0.0))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while it shuts down
    assert not model.layer._forward_pre_hooks
    for key, value in before.items():
        assert torch.equal(value, model.state_dict()[key]), key


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="budget=2"):
        Autopilot(budget=2)
    with pytest.raises(ValueError, match="threshold"):
        Autopilot(threshold=-0.1)
    with pytest.raises(ValueError, match="measure_steps"):
        Autopilot(measure_steps=1)
    with pytest.raises(ValueError, match=r"only=\['turbo'\]"):
        Autopilot(only=["turbo"])
    with pytest.raises(ValueError, match="not an Intervention"):
        Autopilot(interventions=[object()])
    with pytest.raises(ValueError, match="tolerances"):
        Autopilot(tolerances={"data": 0.1})
    with pytest.raises(ValueError, match="nvtx='yes'"):
        Autopilot(nvtx="yes")


def test_nvtx_shows_each_search_phase_as_one_balanced_range(monkeypatch) -> None:
    from lightning_accel.core import nvtx
    from tests.core.test_nvtx import MockNvtx

    mock = MockNvtx()
    monkeypatch.setattr(nvtx, "_default_backend", lambda: mock)
    monkeypatch.setattr(nvtx, "nvtx_unavailable", lambda: None)  # the mock is the backend
    slow = Sleeps()
    autopilot = Autopilot(**FAST, patience=1, only=[], interventions=[slow], save_plan=False, nvtx=True)
    _trainer([autopilot], max_steps=1).fit(Model(sleep_s=0.0), _loader(sleep_s=0.0))
    names = mock.pushed()
    assert mock.balanced(), mock.calls
    assert {c[-1] for c in mock.calls if c[0] in ("push", "pop")} == {"lightning_accel"}
    assert names[0] == "autopilot/baseline" and "autopilot/measuring sleeps" in names, names
    assert all(a != b for a, b in zip(names, names[1:]))  # one range per phase, never the same one twice in a row


# ------------------------------------------------------------------------------------------------ compute fixes
class Attention(nn.Module):
    """nanoGPT-style hand-written causal attention (the pattern use_fused_attention rewrites)."""

    def __init__(self, d: int = 64, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class AttentionModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = Attention()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.attn(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _sequences() -> DataLoader:
    return DataLoader(
        TensorDataset(torch.randn(64, 64, 64)), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7)
    )


def _fused(model) -> bool:
    return bool(model.attn._forward_pre_hooks or model.attn._forward_hooks or "forward" in model.attn.__dict__)


@pytest.mark.parametrize("faster", [True, False])
def test_hand_written_attention_is_fused_and_checked(scripted_speed, faster) -> None:
    model = AttentionModel()
    scripted_speed(lambda run: (2.0 if faster else 0.5) if _fused(run.module) else 1.0)
    autopilot = Autopilot(**FAST, only=["fused_attention"], save_plan=False)
    _trainer([autopilot], max_steps=2).fit(model, _sequences())
    record = next(r for r in autopilot.records if r.name == "fused_attention")
    assert record.numerics is not None and record.numerics["ok"], record
    assert record.numerics["grad_cosine"] > 0.999 and record.samples_per_sec is not None
    assert record.kept is faster and _fused(model) is faster
    assert ("la.use_fused_attention(model, blocks=['attn'])" in autopilot.python) is faster


def test_compile_is_judged_against_its_compile_time(scripted_speed) -> None:
    from lightning_accel._compat import compiled_call
    from lightning_accel.callbacks.autopilot.fixes import Compile

    model = Model(sleep_s=0.0)
    scripted_speed(lambda run: 1.5 if compiled_call(run.module.layer) is not None else 1.0)
    compile_ = Compile(backend="eager")  # dynamo only: fast enough for a unit test; the protocol is the same
    autopilot = Autopilot(**{**FAST, "freeze": []}, only=[], interventions=[compile_], save_plan=False)
    _trainer([autopilot], max_steps=2).fit(model, _loader(sleep_s=0.0))
    record = next(r for r in autopilot.records if r.name == "compile")
    assert record.numerics["ok"] and record.ratio == pytest.approx(1.5)
    # measured 1.5x faster: the judge decides, against the compile time measured in the warm-up and 2 steps left
    assert "s to compile" in record.reason or "compiling takes" in record.reason, record.reason
    assert record.kept is ("saves" in record.reason)
    assert (compiled_call(model.layer) is not None) is record.kept
    assert ("TorchCompile" in autopilot.yaml) is record.kept


@pytest.mark.parametrize("faster", [True, False])
def test_precision_dtype_is_trialled_end_to_end_and_reverted_when_not_kept(scripted_speed, faster) -> None:
    from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

    model = AttentionModel()
    plugin = AutoMixedPrecision(dtype="fp32")
    scripted_speed(lambda run: (2.0 if faster else 0.5) if plugin.compute_dtype == torch.bfloat16 else 1.0)
    autopilot = Autopilot(**FAST, only=["precision"], save_plan=False)
    trainer = _trainer([autopilot], max_steps=2, plugins=[plugin])
    trainer.fit(model, _sequences())
    record = next(r for r in autopilot.records if r.name == "precision")
    assert "bf16" in record.change
    assert record.numerics is not None and record.numerics["kind"] == "low_precision" and record.numerics["ok"]
    assert record.kept is faster and trainer.precision_plugin is plugin
    assert plugin.compute_dtype == (torch.bfloat16 if faster else torch.float32)
    assert ("dtype: bf16" in autopilot.yaml) is faster


@pytest.mark.parametrize("faster", [True, False])
def test_lightnings_default_precision_gets_mixed_precision_installed(scripted_speed, faster) -> None:
    from lightning.pytorch.plugins.precision import Precision

    from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

    model = AttentionModel()
    scripted_speed(
        lambda run: (2.0 if faster else 0.5) if isinstance(run.trainer.precision_plugin, AutoMixedPrecision) else 1.0
    )
    autopilot = Autopilot(**FAST, only=["precision"], save_plan=False)
    trainer = _trainer([autopilot], max_steps=2)  # Lightning's default 32-true
    original = trainer.precision_plugin
    dtypes = []
    model.attn.proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    trainer.fit(model, _sequences())
    record = next(r for r in autopilot.records if r.name == "precision")
    assert record.change == "AutoMixedPrecision(dtype='bf16')" and record.numerics["ok"], record
    assert record.kept is faster
    if faster:
        assert isinstance(trainer.precision_plugin, AutoMixedPrecision)
        assert trainer.precision_plugin.compute_dtype == torch.bfloat16 and dtypes[-1] == torch.bfloat16
        assert "class_path: lightning_accel.AutoMixedPrecision" in autopilot.yaml
        assert "plugins = [la.AutoMixedPrecision(dtype='bf16')]" in autopilot.python
        assert autopilot.plan.kept == [
            {"name": "precision", "params": {"dtype": "bf16"}, "change": "AutoMixedPrecision(dtype='bf16')"}
        ]
    else:
        assert trainer.precision_plugin is original and type(original) is Precision
        assert dtypes[-1] == torch.float32 and autopilot.yaml == ""


def test_freeze_precision_keeps_lightnings_default() -> None:
    autopilot = Autopilot(**{**FAST, "freeze": ["precision"]}, only=["precision", "tf32"], save_plan=False)
    trainer = _trainer([autopilot], max_steps=1)
    original = trainer.precision_plugin
    trainer.fit(AttentionModel(), _sequences())
    rows = {r.name: r for r in autopilot.records}
    assert "frozen" in rows["precision"].reason and "frozen" in rows["tf32"].reason
    assert trainer.precision_plugin is original


def test_tf32_is_offered_only_for_fp32_on_ampere_and_sets_the_matmul_precision(monkeypatch) -> None:
    from types import SimpleNamespace

    from lightning_accel.callbacks.autopilot.fixes import Tf32Matmul

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    plain = SimpleNamespace(precision="32-true")
    run = SimpleNamespace(device=torch.device("cuda", 0), trainer=SimpleNamespace(precision_plugin=plain))
    change = Tf32Matmul()
    before = torch.get_float32_matmul_precision()
    assert before == "highest" and change.unavailable(run) is None
    undo = change.apply(run)
    assert torch.get_float32_matmul_precision() == "high"
    assert "already 'high'" in change.unavailable(run)
    undo()
    assert torch.get_float32_matmul_precision() == "highest"
    assert 'torch.set_float32_matmul_precision("high")' in change.config(run)[1][0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert "no TF32" in change.unavailable(run)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    half = SimpleNamespace(precision="bf16-mixed", compute_dtype=torch.bfloat16)
    assert "16 bits" in change.unavailable(
        SimpleNamespace(device=run.device, trainer=SimpleNamespace(precision_plugin=half))
    )
    assert "CUDA" in change.unavailable(SimpleNamespace(device=torch.device("cpu"), trainer=run.trainer))


def test_optimizer_bound_run_tries_the_fused_and_foreach_steps() -> None:
    class ManyParams(Model):
        def __init__(self) -> None:
            super().__init__(sleep_s=0.0)
            self.extra = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(400)])

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + 1e-3 * sum(p.sum() for p in self.extra[:4])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=False)

    model = ManyParams()
    autopilot = Autopilot(**FAST, only=["optimizer_fused", "optimizer_foreach"], save_plan=False)
    trainer = _trainer([autopilot], max_steps=2)
    trainer.fit(model, _loader(sleep_s=0.0))
    rows = [r for r in autopilot.records if r.name.startswith("optimizer_")]
    assert rows and all(r.numerics is None or r.numerics["ok"] for r in rows), rows
    group = trainer.optimizers[0].param_groups[0]
    kept = {c.name for c in autopilot.kept}
    assert not {"optimizer_foreach", "optimizer_fused"} <= kept, autopilot.records  # alternatives: one is kept
    if "optimizer_foreach" in kept:
        assert group["foreach"] is True and not group["fused"]
    elif "optimizer_fused" in kept:
        assert group["fused"] is True and group["foreach"] is False
        # once the fused step runs, foreach (a step back from one kernel) is not trialled
        foreach = [r for r in rows if r.name == "optimizer_foreach"]
        assert all(r.samples_per_sec is None and "fused step" in r.reason for r in foreach), foreach
    else:  # reverted: the user's own flags
        assert group["foreach"] is False and not group["fused"]


def test_a_resumed_fit_replays_the_plan_from_the_checkpoint(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    autopilot = Autopilot(**FAST, save_plan=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[autopilot, checkpoint],
    )
    trainer.fit(Model(), _loader())
    assert autopilot.kept and autopilot.kept[0].name == "dataloader"
    workers = autopilot.kept[0].params["num_workers"]
    resumed = Autopilot(**FAST, save_plan=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[resumed],
    )
    trainer.fit(Model(), _loader(), ckpt_path=tmp_path / "last.ckpt")
    # every kept change replayed, in order (the first fit may keep more than the loader's workers)
    assert [(r.name, r.reason) for r in resumed.records] == [(k.name, "replayed from the plan") for k in autopilot.kept]
    assert trainer.train_dataloader.num_workers == workers and trainer.global_step == 6


def test_a_search_that_fails_outside_a_trial_leaves_the_training_as_configured() -> None:
    class BrokenProbe(Model):
        calls = 0

        def training_step(self, batch, batch_idx):
            # the 21st step falls in the Autopilot's baseline windows (or its probe): fail there, train fine after
            BrokenProbe.calls += 1
            if BrokenProbe.calls == 21:
                raise RuntimeError("flaky device")
            return super().training_step(batch, batch_idx)

    model = BrokenProbe(sleep_s=0.0)
    autopilot = Autopilot(**FAST, save_plan=False)
    with pytest.warns(UserWarning, match="the search stopped on RuntimeError: flaky device"):
        trainer = _trainer([autopilot], max_steps=3)
        trainer.fit(model, _loader(sleep_s=0.0))
    assert trainer.global_step == 3 and autopilot.kept == []


class Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)) for _ in range(3)])
        self.batch_size = 4

    def training_step(self, batch, batch_idx):
        x, _ = batch
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()

    def train_dataloader(self):
        return _loader(sleep_s=0.0, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_activation_checkpointing_with_a_larger_micro_batch_is_checked_and_undone() -> None:
    from lightning_accel.callbacks.autopilot.fixes import ActivationCheckpointingWithLargerBatch

    model = Blocks()
    change = ActivationCheckpointingWithLargerBatch()
    autopilot = Autopilot(**FAST, only=[], interventions=[change], save_plan=False)
    trainer = _trainer([autopilot], max_steps=2, accumulate_grad_batches=4)
    trainer.fit(model)
    record = next(r for r in autopilot.records if r.name == "activation_checkpointing")
    # recomputation gives the same gradients; the doubled micro-batch only reorders the sums
    assert record.numerics["ok"] and record.numerics["grad_cosine"] > 0.9999, record
    assert "Sequential" in record.change and "batch_size=8" in record.change
    # what stays on is the final state: kept by its trial, unless the claim's final A/B (fresh pairs against the
    # untouched configuration) then measured it slower and reverted it, as a lucky trial window on a noisy
    # machine can make it
    final = [r for r in autopilot.records if r.name == "final A/B"]
    reverted = any(not r.kept and "reverted" in r.reason for r in final)
    kept = change in autopilot.kept
    assert kept == (record.kept and not reverted), (record.reason, [r.reason for r in final])
    wrapped = any("checkpoint" in type(m).__name__.lower() for m in model.modules())
    assert wrapped == kept
    assert (model.batch_size, trainer.accumulate_grad_batches) == ((8, 2) if kept else (4, 4))


def test_the_autopilot_keys_are_logged_once_and_each_trial_when_decided() -> None:
    from lightning.pytorch.loggers import Logger

    class Capture(Logger):
        name, version = "capture", 0
        metrics: list[dict] = []
        steps: list = []

        def log_metrics(self, metrics, step=None):
            self.metrics.append(dict(metrics))
            self.steps.append(step)

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        @property
        def experiment(self):
            return None

    logger = Capture()
    autopilot = Autopilot(**FAST, save_plan=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[autopilot],
    )
    trainer.fit(Model(), _loader())
    # each trial's keys when it is decided, at step = its index in the table
    trials = [(m, s) for m, s in zip(logger.metrics, logger.steps) if "autopilot/trial_kept" in m]
    decided = [r for r in autopilot.records[1:] if not r.reason.startswith(("not applicable", "not trialled"))]
    assert [s for _, s in trials] == [r.index for r in decided] and decided
    for (m, _), r in zip(trials, decided):
        assert m["autopilot/trial_kept"] == float(r.kept)
        assert m.get("autopilot/trial_speedup") == (pytest.approx(r.ratio) if r.ratio is not None else None)
    assert any("autopilot/trial_speedup" in m for m, _ in trials)
    logged = [m for m in logger.metrics if any(k.startswith("autopilot/") and "/trial_" not in k for k in m)]
    assert len(logged) == 1
    keys = {
        "autopilot/baseline_samples_per_sec",
        "autopilot/final_samples_per_sec",
        "autopilot/speedup",
        "autopilot/trials",
        "autopilot/kept",
        "autopilot/noise",
        "autopilot/search_seconds",
    }
    plan = autopilot.plan
    if plan.speedup_low is not None:
        keys |= {"autopilot/speedup_low", "autopilot/speedup_high"}
    assert set(logged[0]) == keys
    # the claim is the final check's, not the ratio of the search's window medians
    assert plan.speedup_source == "final A/B" and autopilot.records[-1].name == "final A/B"
    assert logged[0]["autopilot/speedup"] == pytest.approx(plan.speedup)
    assert logged[0]["autopilot/kept"] == len(autopilot.kept) >= 1


def test_the_doctors_code_smells_add_candidates_tried_in_order_of_expected_gain() -> None:
    class ForLoopAdam(Model):
        def __init__(self) -> None:
            super().__init__(sleep_s=0.0, step_sleep_s=0.01)  # a 10 ms "device" forward: no optimizer finding
            self.extra = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(200)])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=False)

    autopilot = Autopilot(**FAST, save_plan=False)
    _trainer([autopilot], max_steps=1).fit(ForLoopAdam(), _loader(sleep_s=0.0))
    # the optimizer_not_foreach smell (a for-loop step, previewed slower than fused) makes the optimizer fix a
    # candidate although the optimizer is a sliver of the step; candidates go by expected gain (stage share x what
    # the fix removes), so bf16 autocast (a tenth of the forward-bound step on a CPU) is measured first
    trialled = [r.name for r in autopilot.records if r.numerics is not None]
    assert trialled[:2] == ["precision", "optimizer_fused"], [(r.name, r.reason) for r in autopilot.records]


def test_the_validation_loader_gets_the_kept_workers_and_validates_as_often() -> None:
    class Validated(Model):
        def validation_step(self, batch, batch_idx):
            self.validated = getattr(self, "validated", 0) + 1

    def val_loader() -> DataLoader:
        return DataLoader(Sleepy(16, 0.004), batch_size=4)

    model = Validated()
    autopilot = Autopilot(**FAST, only=["dataloader"], save_plan=False)
    trainer = _trainer([autopilot], max_steps=8, val_check_interval=4, limit_val_batches=2)
    trainer.fit(model, _loader(), val_dataloaders=val_loader())
    assert autopilot.kept and autopilot.kept[0].name == "dataloader", autopilot.records
    workers = autopilot.kept[0].params["num_workers"]
    assert trainer.val_dataloaders.num_workers == workers
    assert any(n.startswith("validation DataLoader: num_workers=") and "same batches" in n for n in autopilot.notes)
    reference = Validated()
    _trainer([], max_steps=8, val_check_interval=4, limit_val_batches=2).fit(
        reference, _loader(), val_dataloaders=val_loader()
    )
    assert model.validated == reference.validated == 2 * 2  # twice, two batches each: as often as configured


# ------------------------------------------------------------------------------------------------ attribution order
class LoopLossModel(pl.LightningModule):
    """A small linear layer and a loss summed sample by sample in Python: the step is the loop's small operations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out, total = self.layer(x), x.new_zeros(())
        for i in range(x.shape[0]):
            total = total + ((out[i] - x[i]) ** 2).mean()
        return total / x.shape[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("attributed", [True, False])
def test_the_attribution_orders_the_compute_fixes(monkeypatch, attributed) -> None:
    from lightning_accel.callbacks.autopilot import backend as _autopilot_backend

    offered: list[list[tuple[str, float | None]]] = []
    real = _autopilot_backend.LightningSearchBackend.offers

    def offers(self, shares, tried):
        out = real(self, shares, tried)
        if not tried:  # the pay-back estimate's list, then the first after the baseline
            offered.append([(o.candidate.name, o.gain) for o in out])
        return out

    monkeypatch.setattr(_autopilot_backend.LightningSearchBackend, "offers", offers)
    if not attributed:
        monkeypatch.setattr(_autopilot_backend.LightningSearchBackend, "_compute_findings", lambda *a: [])
    loader = DataLoader(TensorDataset(torch.randn(256, 16)), batch_size=32)
    # compile frozen: offered (with the reason it cannot run) but never compiled here
    autopilot = Autopilot(**FAST, only=["compile", "fused_attention", "tf32", "precision"], save_plan=False)
    _trainer([autopilot], max_steps=2).fit(LoopLossModel(), loader)
    after_baseline = offered[-1]
    names = [n for n, _ in after_baseline]
    if attributed:
        # the loop's finding credits compile with its saving: first, with that gain
        assert names[0] == "compile", after_baseline
        assert dict(after_baseline)["compile"] > 0.3
    else:
        # the priors alone: tf32 (0.3 of compute) and fused attention (0.25) ahead of compile (0.2)
        assert names.index("compile") > names.index("fused_attention"), after_baseline
