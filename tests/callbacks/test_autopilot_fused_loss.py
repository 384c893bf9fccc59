"""The Autopilot's ``fused_cross_entropy`` fix on a Hugging Face causal LM with a large vocabulary: offered when the
doctor's ``large_vocab_loss`` finding fires, kept or reverted by the (scripted) measurement, rejected unmeasured
when the model is never called with labels, refused with the reason where there is nothing to fuse."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks.autopilot import Autopilot
from lightning_accel.callbacks.autopilot.fixes import FusedCrossEntropy
from lightning_accel.callbacks.autopilot.fixes.loss import causal_lms
from lightning_accel.core.autopilot import priors
from tests.callbacks.test_autopilot import FAST, _trainer

transformers = pytest.importorskip("transformers")
VOCAB = 16384  # above the finding's 8,192 classes: the passes over the logits dominate the step


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


class LM(pl.LightningModule):
    def __init__(self, labels: bool = True) -> None:
        super().__init__()
        self.lm, self.labels = _gpt2(), labels

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if self.labels:
            return self.lm(input_ids=ids, labels=ids).loss
        logits = self.lm(input_ids=ids).logits  # the loss computed outside the model, from its logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _ids() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (64, 32), generator=g)), batch_size=4)


def _fused(run_module) -> bool:
    return bool(run_module.lm._forward_pre_hooks)


@pytest.fixture
def trial_on_cpu(monkeypatch):
    """The CPU prior says the fused loss saves no time there (it saves memory), so a fit of known length lists it
    untrialled; these tests give it the GPU's prior to run the trial."""
    monkeypatch.setitem(priors.EXPECTED_REMOVAL, "fused_cross_entropy", {"forward": 0.5, "backward": 0.5})


@pytest.mark.parametrize("faster", [True, False])
def test_the_large_vocabulary_finding_trials_the_fused_loss(scripted_speed, trial_on_cpu, faster) -> None:
    module = LM()
    scripted_speed(lambda run: (2.0 if faster else 0.5) if _fused(run.module) else 1.0)
    autopilot = Autopilot(**{**FAST, "freeze": ["compile"]}, only=["fused_cross_entropy"], save_plan=False)
    _trainer([autopilot], max_steps=2).fit(module, _ids())
    record = next(r for r in autopilot.records if r.name == "fused_cross_entropy")
    assert record.numerics is not None and record.numerics["ok"], record
    assert record.samples_per_sec is not None
    assert record.kept is faster and _fused(module) is faster
    assert ("la.use_fused_linear_cross_entropy(model.lm)" in autopilot.python) is faster
    if not faster:  # reverted: the head builds its logits again
        assert "forward" not in vars(module.lm.lm_head)


def test_a_model_never_called_with_labels_is_rejected_unmeasured(scripted_speed, trial_on_cpu) -> None:
    module = LM(labels=False)
    scripted_speed(lambda run: 1.0)
    autopilot = Autopilot(**FAST, only=["fused_cross_entropy"], save_plan=False)
    with _no_warning():
        _trainer([autopilot], max_steps=2).fit(module, _ids())
    record = next(r for r in autopilot.records if r.name == "fused_cross_entropy")
    assert not record.kept and record.samples_per_sec is None, record
    assert "never called with labels=" in record.reason
    assert not _fused(module) and "forward" not in vars(module.lm.lm_head)


def test_the_finding_names_it_and_on_a_cpu_its_prior_saves_no_time() -> None:
    from lightning_accel.core.autopilot.budget import pays_back
    from lightning_accel.core.findings import Finding, RunContext

    finding = Finding("large_vocab_loss", "forward", "e", "f", 0.3, kind="compute", saving=0.3, module="lm.lm_head")
    shares = {"forward": 0.4, "backward": 0.5, "optimizer": 0.1}
    offered = {
        device: {n: g for n, g, _ in priors.proposal(
            shares, RunContext(), builtin=["compile", "fused_cross_entropy"], extras=[], tried=set(),
            device_type=device, threshold=0.05, accumulate=1, compute=[finding],
        )}
        for device in ("cpu", "cuda")
    }  # fmt: skip
    assert offered["cuda"]["compile"] == pytest.approx(0.3)  # compile holds the finding's measured saving
    assert offered["cuda"]["fused_cross_entropy"] == pytest.approx(0.045)
    assert offered["cpu"]["fused_cross_entropy"] == 0.0
    # a fit of known length (the budget left to the Autopilot) lists it untrialled on a CPU, with the reason
    pays, why = pays_back(offered["cpu"]["fused_cross_entropy"], 1.0, 0.05, 400)
    assert not pays and "expected to save ~0.0 s" in why


def _run(module: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(module=module, device=torch.device("cpu"))


def test_what_it_fuses_and_what_it_refuses() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student, self.head = _gpt2(), nn.Linear(4, 4)

    wrapper = Wrapper()
    assert causal_lms(wrapper) == ["student"]  # outermost only: not its transformer or head
    assert causal_lms(wrapper.student) == [""]
    assert "no Hugging Face causal LM" in FusedCrossEntropy().unavailable(_run(nn.Linear(4, 4)))
    fix = FusedCrossEntropy()
    assert fix.unavailable(_run(wrapper)) is None
    undo = fix.apply(_run(wrapper))
    assert fix.params == {"modules": ["student"]}
    assert "already fused" in FusedCrossEntropy().unavailable(_run(wrapper))
    undo()
    assert FusedCrossEntropy().unavailable(_run(wrapper)) is None
    assert not wrapper.student._forward_pre_hooks and "forward" not in vars(wrapper.student.lm_head)
    with pytest.raises(ValueError, match=r"modules=\['nope'\].*omit modules="):
        FusedCrossEntropy(modules=["nope"]).apply(_run(wrapper))
    wrapper.student.config.final_logit_softcapping = 30.0
    assert "soft-caps its logits" in FusedCrossEntropy().unavailable(_run(wrapper))


def _no_warning():
    import warnings

    class Catch:
        def __enter__(self):
            self._ctx = warnings.catch_warnings(record=True)
            self.caught = self._ctx.__enter__()
            warnings.simplefilter("always")
            return self

        def __exit__(self, *exc):
            self._ctx.__exit__(*exc)
            labels = [w for w in self.caught if "without labels" in str(w.message)]
            assert not labels, labels  # the table says why; the helper's own warning stays quiet in a trial
            return False

    return Catch()
