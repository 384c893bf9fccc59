"""FP8 training through torchao: :class:`Float8Training` converts the model's eligible ``nn.Linear`` layers before the
fit (docs/techniques/float8.md)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FP8_MIN_CAPABILITY", "Float8Training", "float8_layers", "fp8_device_problem", "has_float8_layers"]

#: FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x).
FP8_MIN_CAPABILITY = (8, 9)
_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: names of output heads: excluded unless asked for (the logits' matmul is where FP8 costs accuracy most)
_HEAD_NAMES = ("lm_head", "head", "output", "classifier", "out_proj_vocab")


def _below_torchao_sizes(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's own size rule for its recipes (``_auto_filter_for_recipe``, measured on H100): a layer this small
    runs slower in FP8 than in bf16 (the casts and scales cost more than the faster matmul saves)."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def _heads(model: nn.Module) -> set[str]:
    """The output heads: linears named like one, tied to an embedding's weight, or the last linear of the model."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = {n for n, m in linears if n.rsplit(".", 1)[-1] in _HEAD_NAMES or id(m.weight) in embeddings}
    if linears:
        heads.add(linears[-1][0])
    return heads


def float8_layers(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    min_size: int | Literal["auto"] = "auto",
    include_head: bool = False,
    skip: Sequence[str] = (),
    module_filter: Callable[[nn.Module, str], bool] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The ``nn.Linear`` layers :class:`Float8Training` converts, by qualified name, and why each other one is left
    in high precision (``{name: reason}``); the arguments are the callback's."""
    heads = set() if include_head else _heads(model)
    chosen: list[str] = []
    left: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or type(module).__name__ == "Float8Linear":
            continue
        n, k = module.weight.shape
        if n % 16 or k % 16:
            left[name] = f"{k} -> {n}: FP8 matmuls need both dimensions divisible by 16"
        elif name in heads:
            left[name] = "the output head (include_head=True converts it)"
        elif any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
            left[name] = "skipped by skip=[...]"
        elif module_filter is not None and not module_filter(module, name):
            left[name] = "refused by module_filter"
        elif min_size == "auto" and _below_torchao_sizes(recipe, n, k):
            left[name] = f"{k} -> {n}: below torchao's size for the {recipe} recipe (slower than bf16 there)"
        elif isinstance(min_size, int) and not isinstance(min_size, bool) and min(n, k) < min_size:
            left[name] = f"{k} -> {n}: a dimension below min_size={min_size}"
        else:
            chosen.append(name)
    return chosen, left


def has_float8_layers(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds torchao ``Float8Linear`` layers (converted already)."""
    return any(type(m).__name__ == "Float8Linear" for m in module.modules())


def fp8_device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run FP8 matmuls (a CPU, or a GPU below :data:`FP8_MIN_CAPABILITY`), or ``None``."""
    if device.type != "cuda":
        return f"{device} has no FP8 matmuls (they need a GPU of compute capability >= 8.9: Ada, Hopper, Blackwell)"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (
            f"{torch.cuda.get_device_name(device)} ({device}) has compute capability {capability[0]}.{capability[1]}; "
            "FP8 matmuls need >= 8.9 (Ada, Hopper, Blackwell)"
        )
    return None


class Float8Training(Callback):
    """Trains the model's large ``nn.Linear`` layers in FP8 with torchao (``convert_to_float8_training``): their
    matmuls run on FP8 tensor cores, the rest of the model in the precision the Trainer has (``bf16-mixed``).

    A callback, not a precision plugin: it composes with the precision the user picked (a Trainer takes one plugin)
    and converts modules the way ``TorchCompile`` compiles them, at setup, before FSDP2 wraps the model.

    Which layers: both dimensions divisible by 16; at least torchao's measured size for the recipe
    (``min_size="auto"``), or every dimension at least ``min_size``; not the output head (``include_head=True``);
    not those matching ``skip`` (``fnmatch`` patterns of qualified names); and ``module_filter(module, name)`` when
    given. ``converted`` and ``left_out`` (name → reason) say what happened; a model with nothing to convert raises.

    Refuses at setup, in one line naming the device and its compute capability, on a GPU below 8.9 or a CPU, unless
    ``emulate=True`` (torchao's emulation: the same casts and scales, the matmul in high precision; for tests).
    Warns when no ``TorchCompile`` is in the callbacks: FP8 without compile is slower than bf16 with it. Under FSDP2
    with the tensorwise recipe the weights are all-gathered in FP8 (``fsdp_float8_all_gather``), their scales
    computed once after each optimizer step. Checkpoints hold plain weights (the state dict of the unconverted
    model): a checkpoint saved under FP8 resumes without it and the other way round.

    Args:
        recipe: ``"tensorwise"`` (fastest), ``"rowwise"`` (more accurate, needs the CUTLASS kernel) or
            ``"rowwise_with_gw_hp"`` (the weight gradient in high precision).
        min_size: ``"auto"`` (torchao's size rule), or the smallest dimension converted (``0``: any).
        include_head: convert the output head too.
        skip: ``fnmatch`` patterns of layer names to leave in high precision.
        module_filter: ``(module, name) -> bool``, a further filter of your own.
        emulate: run torchao's emulation (any device; slow, for tests).
        fsdp_float8_all_gather: all-gather weights in FP8 under FSDP2; ``None``: on with the tensorwise recipe.
    """

    def __init__(
        self,
        *,
        recipe: str = "tensorwise",
        min_size: int | Literal["auto"] = "auto",
        include_head: bool = False,
        skip: Sequence[str] = (),
        module_filter: Callable[[nn.Module, str], bool] | None = None,
        emulate: bool = False,
        fsdp_float8_all_gather: bool | None = None,
    ) -> None:
        if recipe not in _RECIPES:
            raise ValueError(f"Float8Training(recipe={recipe!r}): use one of {', '.join(map(repr, _RECIPES))}")
        if min_size != "auto" and (isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0):
            raise ValueError(f"Float8Training(min_size={min_size!r}): use 'auto' or a number of features >= 0")
        if isinstance(skip, str):
            skip = [skip]
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(
                f"Float8Training(fsdp_float8_all_gather=True, recipe={recipe!r}): torchao all-gathers in FP8 with "
                "the tensorwise recipe only; drop one of them"
            )
        self.recipe, self.min_size, self.include_head = recipe, min_size, include_head
        self.skip, self.module_filter, self.emulate = list(skip), module_filter, bool(emulate)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.converted: list[str] = []
        self.left_out: dict[str, str] = {}
        self._all_gather = False

    @property
    def compute_dtype(self) -> str | None:
        """``"fp8"`` once layers run on FP8 tensor cores (what ``MFUMonitor`` reads the peak for); ``None`` under
        emulation or before the conversion (the matmuls then run in the Trainer's precision)."""
        return "fp8" if self.converted and not self.emulate else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or has_float8_layers(pl_module):  # a second fit of a converted model: nothing to do
            return
        self._check_device(trainer.strategy.root_device)
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as err:
            raise ImportError(f"Float8Training needs torchao ({err}): pip install 'lightning-accel[torchao]'") from err
        chosen, self.left_out = float8_layers(
            pl_module, recipe=self.recipe, min_size=self.min_size, include_head=self.include_head, skip=self.skip,
            module_filter=self.module_filter,
        )  # fmt: skip
        if not chosen:
            shown = "; ".join(f"{n}: {why}" for n, why in list(self.left_out.items())[:4]) or "no nn.Linear"
            raise ValueError(
                f"Float8Training: no layer of {type(pl_module).__name__} to train in FP8 ({shown}); FP8 pays on "
                "large matmuls (torchao's sizes: min_size='auto'); min_size=0 converts every layer whose "
                "dimensions divide by 16"
            )
        self._all_gather = self._fsdp_all_gather(trainer)
        config = Float8LinearConfig.from_recipe_name(self.recipe)
        from dataclasses import replace

        config = replace(config, emulate=self.emulate, enable_fsdp_float8_all_gather=self._all_gather)
        wanted = set(chosen)
        convert_to_float8_training(pl_module, module_filter_fn=lambda _m, fqn: fqn in wanted, config=config)
        self.converted = chosen
        from lightning_accel.callbacks.torch_compile import TorchCompile

        if not self.emulate and not any(isinstance(cb, TorchCompile) for cb in trainer.callbacks):
            rank_zero_warn(
                "Float8Training without TorchCompile: the casts to FP8 run as separate kernels and the step is "
                "slower than bf16 with compile; add TorchCompile() to the callbacks"
            )
        rank_zero_info(
            f"Float8Training: {len(chosen)} of {len(chosen) + len(self.left_out)} linear layers in FP8 "
            f"({self.recipe}{', emulated' if self.emulate else ''}{', FP8 all-gather' if self._all_gather else ''})"
        )

    def _check_device(self, device: torch.device) -> None:
        problem = None if self.emulate else fp8_device_problem(device)
        if problem is not None:
            hint = (
                "train in bf16 here (precision='bf16-mixed')" if device.type == "cuda" else "remove Float8Training here"
            )
            raise RuntimeError(f"Float8Training: {problem}: {hint}, or pass emulate=True to test the numerics")

    def _fsdp_all_gather(self, trainer: pl.Trainer) -> bool:
        if self.fsdp_float8_all_gather is not None:
            return bool(self.fsdp_float8_all_gather) and self.recipe == "tensorwise"
        from lightning.pytorch.strategies import ModelParallelStrategy

        return self.recipe == "tensorwise" and isinstance(trainer.strategy, ModelParallelStrategy)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._all_gather:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        # after each optimizer step: one all-reduce for every FP8 weight's scale, not one per layer per gather
        self._hooks = [
            opt.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(pl_module))
            for opt in trainer.optimizers
        ]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

        for hook in getattr(self, "_hooks", ()):
            hook.remove()
        self._hooks = []
        finish_collectives_at_teardown(self, trainer)
