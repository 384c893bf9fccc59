"""Hugging Face models on the library's own SDPA attention (``set_attn_implementation("sdpa")``), and the way
back."""

from __future__ import annotations

from torch import nn

from lightning_accel import _compat

#: attention implementations of ``transformers`` that already run a fused kernel
_FUSED_HF = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


class _SwitchBack:
    """A handle that puts a Hugging Face model back on the attention implementation it had."""

    def __init__(self, model: nn.Module, implementation: str) -> None:
        self.model, self.implementation = model, implementation

    def remove(self) -> None:
        self.model.set_attn_implementation(self.implementation)  # type: ignore[operator]


def _hf_models(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost ``transformers`` models inside ``model`` (by module name)."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(name == outer or name.startswith(outer + ".") or outer == "" for outer in found):
            continue
        if _compat.hf_attn_implementation(module) is not None:
            found[name] = module
    return found


def _switch_hf(name: str, model: nn.Module) -> str | None:
    """Switch one Hugging Face model to ``attn_implementation="sdpa"``; the reason when it cannot be done."""
    before = _compat.hf_attn_implementation(model)
    if before in _FUSED_HF or (isinstance(before, str) and before.startswith("kernels-")):
        return None  # already fused
    label = f"{type(model).__name__}{f' ({name})' if name else ''}"
    if not hasattr(model, "set_attn_implementation"):
        import transformers

        return (
            f"{label}: transformers {transformers.__version__} has no set_attn_implementation (added in "
            "4.5x); build the model with attn_implementation='sdpa' (from_pretrained / from_config) instead"
        )
    try:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    except (ValueError, ImportError, NotImplementedError) as err:  # e.g. the class has _supports_sdpa = False
        return f"{label}: set_attn_implementation('sdpa') refused: {err}"
    now = _compat.hf_attn_implementation(model)
    if now != "sdpa":
        return (
            f"{label}: set_attn_implementation('sdpa') left it on {now!r} (the class does not dispatch through "
            "transformers' AttentionInterface)"
        )
    return None


def _hf_attention_modules(model: nn.Module, prefix: str) -> list[str]:
    """Names of a Hugging Face model's attention modules (class name ending in Attention), outermost only."""
    chosen: list[str] = []
    for name, module in model.named_modules():
        if (
            name
            and type(module).__name__.endswith("Attention")
            and not any(name.startswith(outer + ".") for outer in chosen)
        ):
            chosen.append(name)
    return [f"{prefix}.{name}" if prefix else name for name in chosen]
