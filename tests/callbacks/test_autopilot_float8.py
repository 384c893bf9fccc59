"""The Autopilot's ``float8`` fix: offered only on a GPU of compute capability >= 8.9 and on top of bf16 and compile
(each missing condition named), ranked after every other fix, and a conversion whose undo returns the original
layers with the optimizer's parameters untouched (torchao's emulation on a CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_accel.callbacks.autopilot.fixes import Float8
from lightning_accel.callbacks.autopilot.fixes.base import Run
from lightning_accel.callbacks.autopilot.fixes.float8 import _has_torchao_float8
from lightning_accel.core.autopilot.priors import proposal, rank_by_expected_gain
from lightning_accel.core.findings import RunContext


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4096, 2048), nn.GELU(), nn.Linear(2048, 4096), nn.Linear(4096, 32))


def _run(module: nn.Module, device: str = "cuda", precision: str = "bf16-mixed", callbacks=()) -> Run:
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(device)),
        callbacks=list(callbacks),
        precision_plugin=SimpleNamespace(),
        precision=precision,
    )
    return Run(trainer=trainer, module=module, source=None, config=None, runner=None)  # type: ignore[arg-type]


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def _compiled(module: nn.Module) -> nn.Module:
    from lightning_accel import _compat

    _compat.set_compiled_call(module[0], lambda *a, **k: None)  # as TorchCompile leaves it
    return module


def test_it_is_offered_only_on_an_fp8_gpu_on_top_of_bf16_and_compile(hopper, monkeypatch) -> None:
    assert "cpu has no FP8 matmuls" in Float8().unavailable(_run(_model(), device="cpu"))
    if not _has_torchao_float8():
        assert "needs torchao" in Float8().unavailable(_run(_compiled(_model())))
        return
    assert "tried on top of bf16" in Float8().unavailable(_run(_compiled(_model()), precision="32-true"))
    assert "on top of compile" in Float8().unavailable(_run(_model()))
    small = _compiled(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
    assert "no linear layer large enough" in Float8().unavailable(_run(small))
    assert Float8().unavailable(_run(_compiled(_model()))) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert "A100-SXM4-80GB (cuda) has compute capability 8.0" in Float8().unavailable(_run(_compiled(_model())))


def test_it_is_ranked_after_bf16_and_compile_whatever_the_priors() -> None:
    shares = {"forward": 0.45, "backward": 0.45, "optimizer": 0.1}
    names = rank_by_expected_gain(["float8", "compile", "precision"], shares, "cuda", measured={"compile": 0.01})
    assert names[-1] == "float8"
    offered = [n for n, _, _ in proposal(
        shares, RunContext(device_type="cuda"), builtin=["precision", "compile", "float8"], extras=[], tried=set(),
        device_type="cuda", threshold=0.05, accumulate=1,
    )]  # fmt: skip
    assert offered.index("float8") > max(offered.index("compile"), offered.index("precision"))


@pytest.mark.skipif(not _has_torchao_float8(), reason="needs torchao")
def test_the_undo_returns_the_original_layers_sharing_their_parameters() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    originals, params = list(model), list(model.parameters())
    fix = Float8(emulate=True, min_size=0)
    undo = fix.apply(_run(model, device="cpu"))
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    assert type(model[3]) is nn.Linear  # the head (the last linear) stays
    assert list(model.parameters()) == params  # the optimizer's tensors
    model(torch.randn(4, 32)).sum().backward()
    assert "2 linear layers" in fix.describe(None)  # type: ignore[arg-type]
    undo()
    assert list(model) == originals and all(type(m) in (nn.Linear, nn.ReLU) for m in model)
    assert fix.config(None)[0] == [("trainer.callbacks", [{"class_path": "lightning_accel.Float8Training"}])]  # type: ignore[arg-type]
