"""Framework-free pieces of the precision/checkpointing plugins: names, wrapping round trip, supported dtypes."""

from __future__ import annotations

import torch
from torch import nn

from lightning_accel.core.checkpointing import (
    apply_activation_checkpointing,
    clean_module_name,
    remove_activation_checkpointing,
)
from lightning_accel.core.precision import supported_autocast_dtypes


def test_clean_module_name_drops_wrapper_segments() -> None:
    assert clean_module_name("model.blocks.0._checkpoint_wrapped_module.ln.weight") == "model.blocks.0.ln.weight"
    assert clean_module_name("_orig_mod.blocks.1._checkpoint_wrapped_module") == "blocks.1"
    assert clean_module_name("_checkpoint_wrapped_module") == ""
    assert clean_module_name("head.weight") == "head.weight"


def test_wrap_then_remove_restores_the_same_modules() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    originals = [model[0], model[2]]
    # "2" and the Linear type both match inside model[2]: only the outermost is wrapped
    assert apply_activation_checkpointing(model, [nn.Linear, "2"]) == ["0", "2"]
    assert type(model[0]).__name__ == "CheckpointWrapper" and type(model[2][0]) is nn.Linear
    assert apply_activation_checkpointing(model, ["0"]) == ["0"]  # already wrapped: not wrapped twice
    assert not hasattr(model[0]._checkpoint_wrapped_module, "_checkpoint_wrapped_module")
    assert remove_activation_checkpointing(model) == 2
    assert [model[0], model[2]] == originals


def test_cpu_supports_both_half_dtypes_in_autocast() -> None:
    assert supported_autocast_dtypes("cpu") == ["bf16", "fp16"]
    assert supported_autocast_dtypes(torch.device("cpu")) == ["bf16", "fp16"]
