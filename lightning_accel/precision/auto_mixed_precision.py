"""AutoMixedPrecision: Lightning mixed precision that picks the dtype for the device, keeps chosen layers in fp32,
exposes its GradScaler settings, and counts the optimizer steps the scaler skipped."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim import LBFGS
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel._checks import check_int
from lightning_accel.core.precision import DtypeChoice, Fp32Islands, choose_autocast_dtype

_compat.require_versions("AutoMixedPrecision")

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AutoMixedPrecision"]

_DTYPES = ("auto", "bf16", "fp16", "fp32")
_PRECISION_STR = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed", torch.float32: "32-true"}


class AutoMixedPrecision(MixedPrecision):
    """Mixed precision that chooses the dtype for the device, with fp32 islands and a configurable GradScaler.

    Use it in place of Lightning's ``precision=`` string::

        trainer = Trainer(plugins=[AutoMixedPrecision()])                       # dtype="auto"
        trainer = Trainer(plugins=[AutoMixedPrecision(dtype="fp16", fp32_modules=[nn.LayerNorm, "*.head"])])

    **dtype="auto"** (resolved when ``fit`` sets up, on the device the strategy trains on; see
    :mod:`lightning_accel.core.precision` for the full rule): on a CUDA GPU, bf16 when the GPU has it in hardware
    (Ampere and newer), else fp16 with a GradScaler; on a CPU, a short matmul probe (≈0.1–0.5 s, once per
    process) times fp32 against bf16/fp16 autocast, and the fastest half dtype is used only if it is at least 1.10×
    faster, else training stays in fp32 (the plugin then adds nothing but its statistics). An explicit ``"bf16"``
    or ``"fp16"`` the device does not support raises a ``ValueError`` listing what it supports.

    **fp32 islands**: ``fp32_modules`` entries are module types (``nn.LayerNorm``) or ``fnmatch`` patterns over
    qualified module names (``"*.softmax"``, ``"loss_fn"``); matched modules run with autocast disabled, their
    half-precision floating inputs upcast to fp32 and their outputs fp32 (forward hooks; ``state_dict`` keys are
    unchanged). Entries matching nothing trigger a warning naming them.

    **GradScaler** (fp16 only; bf16 and fp32 need none): ``init_scale=2**16``, ``growth_factor=2.0``,
    ``backoff_factor=0.5``, ``growth_interval=2000`` are PyTorch's defaults and the method's recommendation. The
    scaler's state is saved in and restored from checkpoints (under the key ``"AutoMixedPrecision"``). Gradients
    are unscaled before ``on_before_optimizer_step`` and clipping, also with gradient accumulation.

    Statistics (attributes, read by ``BottleneckDoctor``; logged by :class:`~lightning_accel.NonFiniteGuard` as
    ``amp/loss_scale``, ``amp/skipped_steps``, ``amp/total_steps``):

    ====================  ===========  ====================================================================
    attribute             unit         meaning (this process / device)
    ====================  ===========  ====================================================================
    ``compute_dtype``     torch.dtype  autocast dtype, or ``torch.float32`` when fp32 was kept; ``None``
                                       before ``fit`` resolved ``dtype="auto"``
    ``loss_scale``        factor       current GradScaler scale; ``None`` without a scaler
    ``skipped_steps``     steps        optimizer steps the GradScaler skipped (inf/nan gradients found)
    ``total_steps``       steps        optimizer steps attempted through this plugin
    ``reason``            text         why ``compute_dtype`` was chosen
    ====================  ===========  ====================================================================

    The skipped-step counter is a device tensor, so counting never synchronises; reading ``skipped_steps`` or
    ``loss_scale`` does (read them when logging, not on every step).

    Args:
        dtype: ``"auto"``, ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        device: resolve the dtype now for this device (``"cuda"``, ``"cpu"``) instead of at ``fit`` setup.
        fp32_modules: module types and/or name patterns to keep in fp32.
        init_scale: initial loss scale (fp16).
        growth_factor: scale multiplier after ``growth_interval`` steps without inf/nan (fp16).
        backoff_factor: scale multiplier after a step with inf/nan gradients (fp16).
        growth_interval: consecutive finite steps before the scale grows (fp16).
    """

    def __init__(
        self,
        *,
        dtype: str = "auto",
        device: str | torch.device | None = None,
        fp32_modules: Sequence[type | str] = (),
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"AutoMixedPrecision(dtype={dtype!r}): use one of {', '.join(map(repr, _DTYPES))}")
        if isinstance(fp32_modules, (str, type)):
            fp32_modules = [fp32_modules]
        bad = [
            m for m in fp32_modules if not (isinstance(m, str) or (isinstance(m, type) and issubclass(m, nn.Module)))
        ]
        if bad:
            raise ValueError(
                f"AutoMixedPrecision(fp32_modules=...): {bad!r} are neither nn.Module types nor name "
                "patterns; pass e.g. [nn.LayerNorm, '*.head']"
            )
        if not _positive(init_scale):
            raise ValueError(f"AutoMixedPrecision(init_scale={init_scale!r}): use a positive finite scale, e.g. 2**16")
        if not _positive(growth_factor) or growth_factor <= 1:
            raise ValueError(f"AutoMixedPrecision(growth_factor={growth_factor!r}): use a factor > 1, e.g. 2.0")
        if not _positive(backoff_factor) or backoff_factor >= 1:
            raise ValueError(f"AutoMixedPrecision(backoff_factor={backoff_factor!r}): use a factor in (0, 1), e.g. 0.5")
        check_int("AutoMixedPrecision", "growth_interval", growth_interval, unit="steps", example=2000)
        # deliberately not MixedPrecision.__init__: the dtype (and so the scaler) is only known once the device is
        self.dtype = dtype
        self.fp32_modules = list(fp32_modules)
        self.scaler_kwargs = {
            "init_scale": float(init_scale),
            "growth_factor": float(growth_factor),
            "backoff_factor": float(backoff_factor),
            "growth_interval": growth_interval,
        }
        self.precision = "32-true"  # Lightning's precision string; set for real by _resolve
        self.device = "cpu"  # autocast device type
        self.scaler: torch.amp.GradScaler | None = None
        self.choice: DtypeChoice | None = None
        self.total_steps = 0
        self._skipped: torch.Tensor | None = None
        self._skipped_offset = 0  # restored from a checkpoint
        self._islands: Fp32Islands | None = None
        self._pending_state: dict[str, Any] | None = None
        if device is not None:
            self._resolve(torch.device(device))

    # ------------------------------------------------------------------ statistics
    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.choice.dtype if self.choice is not None else None

    @property
    def reason(self) -> str | None:
        return self.choice.reason if self.choice is not None else None

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        counted = int(self._skipped.item()) if self._skipped is not None else 0
        return self._skipped_offset + counted

    @property
    def fp32_module_names(self) -> list[str]:
        """Qualified names of the modules running as fp32 islands in the current ``fit``."""
        return list(self._islands.names) if self._islands is not None else []

    # ------------------------------------------------------------------ set-up
    def _resolve(self, device: torch.device) -> None:
        if self.choice is not None and self.device == device.type:
            return
        choice = choose_autocast_dtype(device, self.dtype)
        self.choice = choice
        self.device = device.type
        self.precision = _PRECISION_STR[choice.dtype]
        if choice.needs_scaler:
            self.scaler = torch.amp.GradScaler(device.type, **self.scaler_kwargs)
        else:
            self.scaler = None
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Resolve the dtype for the strategy's device and install the fp32 islands (called by the strategy)."""
        trainer = _compat.module_trainer(module)
        if trainer is not None:
            device = trainer.strategy.root_device
        else:
            param = next(module.parameters(), None)
            device = param.device if param is not None else torch.device(self.device)
        self._resolve(device)
        rank_zero_info(
            f"AutoMixedPrecision: compute dtype {str(self.compute_dtype).replace('torch.', '')} "
            f"({self.reason})" + (f"; GradScaler {self.scaler_kwargs}" if self.scaler else "")
        )
        self.remove_islands()
        if self.fp32_modules:
            self._islands = Fp32Islands(module, self.fp32_modules, self.device)
            if self._islands.unmatched:
                types = sorted({type(m).__name__ for m in module.modules()})
                rank_zero_warn(
                    f"AutoMixedPrecision(fp32_modules=...): {Fp32Islands.describe(self._islands.unmatched)} "
                    f"matched no module of {type(module).__name__} (module types present: "
                    f"{', '.join(types)}); name patterns match qualified names such as "
                    f"{[n for n, _ in module.named_modules() if n][:3]}"
                )
        return module

    def remove_islands(self) -> None:
        """Remove the fp32-island hooks (done at teardown, so the model behaves normally after ``fit``)."""
        if self._islands is not None:
            self._islands.remove()
            self._islands = None

    @override
    def teardown(self) -> None:
        self.remove_islands()
        super().teardown()

    # ------------------------------------------------------------------ autocast
    @override
    def autocast_context_manager(self) -> torch.autocast:
        dtype = self.compute_dtype or torch.float32
        # cache_enabled=False as in Lightning's MixedPrecision (the autocast weight cache is per region anyway)
        return torch.autocast(
            self.device,
            dtype=dtype if dtype != torch.float32 else torch.bfloat16,
            enabled=dtype != torch.float32,
            cache_enabled=False,
        )

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.compute_dtype in (None, torch.float32):
            yield  # fp32 kept: leave any autocast the user set up alone
            return
        with self.autocast_context_manager():
            yield

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        self.total_steps += 1
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # Same order as Lightning's MixedPrecision (2.6), plus counting the steps the scaler skips.
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("AutoMixedPrecision with fp16 (GradScaler) does not support LBFGS")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not _compat.optimizer_handles_unscaling(optimizer) and not skip_unscaling:
            self.scaler.unscale_(optimizer)  # before on_before_optimizer_step and gradient clipping
        _compat.after_closure(self, model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self._count_skip(optimizer)
        self.scaler.update()
        return step_output

    def _count_skip(self, optimizer: Any) -> None:
        # GradScaler keeps the per-device found-inf flags of this step until update(); reading them is the only way
        # to know whether step() skipped without a host sync (a private GradScaler field: see _compat).
        flags = _compat.grad_scaler_found_inf(self.scaler, optimizer)
        if not flags:
            return
        hit = (sum(f.to(flags[0].device) for f in flags) > 0).to(torch.int64)
        self._skipped = hit if self._skipped is None else self._skipped.to(hit.device) + hit

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.compute_dtype).replace("torch.", "") if self.compute_dtype else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" not in state_dict and "scale" in state_dict:  # a bare GradScaler state (MixedPrecision's)
            state_dict = {"scaler": state_dict}
        if self.choice is None:  # before setup: apply once the dtype (and scaler) exist
            self._pending_state = dict(state_dict)
            return
        scaler_state = state_dict.get("scaler")
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)
        elif scaler_state and self.scaler is None:
            rank_zero_info(
                f"AutoMixedPrecision: the checkpoint has GradScaler state but this run uses "
                f"{self.compute_dtype}, which needs no scaler; ignoring it"
            )
        self.total_steps = int(state_dict.get("total_steps", 0))
        self._skipped_offset = int(state_dict.get("skipped_steps", 0))
        self._skipped = None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
