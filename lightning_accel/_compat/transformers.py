"""transformers' private names: the registry entries and the accessors that reach them.

transformers is optional and imported inside the functions that need it, so importing this module does not import
it; its entries are checked only where it is installed. The policy: ``docs/architecture.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_accel._compat.registry import PrivateName


def _hf_config() -> Any:
    from transformers import PretrainedConfig

    return PretrainedConfig()


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        "transformers.PretrainedConfig",
        "_attn_implementation",
        "transformers 5.0-5.24",
        ("attention/fused.py:use_fused_attention", "core/smells.py:_hf_eager"),
        instance=_hf_config,
        why="what transformers' attention dispatch reads; the config has no public getter",
    ),
    PrivateName(
        "transformers.PreTrainedModel",
        "_tp_plan",
        "transformers 5.0-5.24",
        ("strategies/parallel_plan.py:_hf_plan",),
        why="older transformers expose the tensor-parallel plan only as this class attribute",
    ),
    PrivateName(
        "transformers.PreTrainedModel",
        "_supports_sdpa",
        "transformers 5.0-5.24",
        ("attention/hf_switch.py:_hf_models", "core/checkpointing.py:disable_kv_cache"),
        why="the class flag that tells a PreTrainedModel from its layers (same config)",
    ),
)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """A ``transformers`` model's tensor-parallel plan: ``model.tp_plan`` where the version has it, else the class's
    ``_tp_plan``; ``{}`` for other modules."""
    return dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})


def hf_supports_sdpa(module: nn.Module) -> bool:
    """Whether a ``transformers`` model class declares SDPA support (its ``_supports_sdpa`` class flag)."""
    return bool(getattr(module, "_supports_sdpa", False))


def hf_attn_implementation(module: nn.Module) -> str | None:
    """A ``transformers`` model's attention implementation (``"eager"``, ``"sdpa"``, ...); None for other modules.

    ``config._attn_implementation`` is what the library's attention dispatch reads; ``_supports_sdpa`` (a class
    flag of every ``PreTrainedModel``) tells a model from its layers, which hold the same config. Checked against
    transformers 5.0-5.24.
    """
    config = getattr(module, "config", None)
    # a PreTrainedModel (not one of its layers, which also hold the config): it has the SDPA support flag
    if config is None or not (hasattr(module, "set_attn_implementation") or hasattr(module, "_supports_sdpa")):
        return None
    value = getattr(config, "_attn_implementation", None)
    return value if isinstance(value, str) else None


def hf_causal_mask(config: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The causal attention mask a Hugging Face decoder builds for ``hidden`` (no padding, no cache), as its own
    forward does: ``transformers.masking_utils.create_causal_mask``, whose signature changed inside 5.x
    (5.0: ``input_embeds``, ``cache_position``, ``past_key_values``; 5.24: ``inputs_embeds``, ``cache``). Checked
    against transformers 5.0.0 and 5.24."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    if "inputs_embeds" in params:
        return create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
    cache_position = torch.arange(hidden.shape[1], device=hidden.device)
    return create_causal_mask(
        config=config,
        input_embeds=hidden,
        attention_mask=None,
        cache_position=cache_position,
        past_key_values=None,
        position_ids=position_ids,
    )
