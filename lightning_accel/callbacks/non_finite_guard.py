"""NonFiniteGuard: skip optimizer steps whose loss or gradients are inf/nan, name the culprits, stop on a streak."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel._checks import check_int
from lightning_accel.core.checkpointing import clean_module_name
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

_compat.require_versions("NonFiniteGuard")

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard(Callback):
    """Checks the loss and the gradients for inf/nan before every optimizer step and skips the step when any is.

    The check is one fused reduction: ``torch._foreach_norm(grads, inf)`` (the largest magnitude of each gradient;
    inf/nan propagate, and unlike the 2-norm it cannot overflow on large finite fp16 gradients), stacked with the
    finiteness of every micro-batch's loss, then a single host read per optimizer step — the same one sync a
    ``GradScaler`` makes. Under DDP the verdict is summed across ranks (one tiny all-reduce) so every rank skips
    together. Only on a bad step are the parameters with non-finite gradients looked up and named.

    How the step is skipped: a Lightning hook cannot veto ``optimizer.step`` (``on_before_optimizer_step`` runs
    inside the closure that ``optimizer.step`` calls), and zeroing gradients is not a no-op for Adam (its moments
    still decay, weight decay still applies). So the guard wraps each optimizer's ``step`` for the duration of
    ``fit``: the wrapper runs the closure (forward, backward, checks, clipping) and then calls the real ``step``
    only if the check passed. Parameters *and* optimizer state stay bit-identical across a skipped step. When a
    ``GradScaler`` (fp16) is active, it already skips steps with inf/nan gradients; the guard counts those as bad
    steps but leaves the skipping to the scaler (``nonfinite/skipped_steps`` counts only the guard's own skips).

    After ``max_consecutive`` bad optimizer steps in a row, training stops with a ``RuntimeError`` naming the
    parameters and the fixes to try; no bad value has been written into the weights at that point. With a
    GradScaler its back-off skips count towards the streak too (a scale that needs ``max_consecutive`` halvings
    in a row means ``init_scale`` is far too high, or the model diverged). With manual optimization the guard
    checks, counts, logs and stops, but the skipping is yours (it does not wrap your ``optimizer.step`` calls).

    Logged through ``pl_module.log`` (on step):

    ============================  ======  =====================================================================
    key                           unit    meaning (identical on every rank)
    ============================  ======  =====================================================================
    ``nonfinite/bad_steps``       steps   optimizer steps so far with an inf/nan loss or gradient
    ``nonfinite/skipped_steps``   steps   optimizer steps the guard skipped (bad steps without a GradScaler)
    ``amp/loss_scale``            factor  current GradScaler scale (only with a scaler; every
                                          ``log_every_n_steps``)
    ``amp/skipped_steps``         steps   steps the precision plugin's GradScaler skipped (``AutoMixedPrecision``)
    ``amp/total_steps``           steps   optimizer steps through the precision plugin (``AutoMixedPrecision``)
    ============================  ======  =====================================================================

    Args:
        max_consecutive: bad optimizer steps in a row that stop training (>= 1).
        check_loss: also check the loss of each micro-batch (the gradients are always checked).
        max_names: how many parameter names to report for a bad step.
        log_amp_stats: log the ``amp/*`` keys of the precision plugin.

    Attributes:
        bad_steps, skipped_steps, consecutive: the counters; ``last_bad_params``: names from the last bad step.
    """

    def __init__(
        self, *, max_consecutive: int = 10, check_loss: bool = True, max_names: int = 5, log_amp_stats: bool = True
    ) -> None:
        check_int("NonFiniteGuard", "max_consecutive", max_consecutive, example=10)
        check_int("NonFiniteGuard", "max_names", max_names, example=5)
        self.max_consecutive = max_consecutive
        self.check_loss = check_loss
        self.max_names = max_names
        self.log_amp_stats = log_amp_stats
        self.bad_steps = 0
        self.skipped_steps = 0
        self.consecutive = 0
        self.last_bad_params: list[str] = []
        self._names: dict[int, str] = {}
        self._loss_ok: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []  # this optimizer step's micro-batch losses (detached)
        self._skip: dict[int, bool] = {}
        self._patched: list[tuple[Any, Any, bool]] = []  # (optimizer, previous step attribute, had own attribute)

    # ------------------------------------------------------------------ fit lifetime
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names = {id(p): clean_module_name(n) for n, p in pl_module.named_parameters()}
        self._loss_ok, self._skip, self._losses = None, {}, []
        if pl_module.automatic_optimization:
            for optimizer in trainer.optimizers:
                self._wrap_step(optimizer)

    def _wrap_step(self, optimizer: Any) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "NonFiniteGuard cannot guard LBFGS (it calls the closure several times per step); "
                "remove NonFiniteGuard or use another optimizer"
            )
        had_own = "step" in vars(optimizer)
        original = optimizer.step
        key = id(optimizer)

        def guarded_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()  # forward, backward, on_before_optimizer_step (the check), clipping
            if self._skip.pop(key, False):
                self.skipped_steps += 1
                return loss
            if closure is None:
                return original(**kwargs)
            original(**kwargs)
            return loss

        optimizer.step = guarded_step
        self._patched.append((optimizer, original, had_own))

    def _unwrap(self) -> None:
        for optimizer, original, had_own in reversed(self._patched):
            if had_own:
                optimizer.step = original
            else:
                vars(optimizer).pop("step", None)
        self._patched.clear()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unwrap()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unwrap()

    # ------------------------------------------------------------------ checks
    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if not self.check_loss:
            return
        loss = loss.detach()
        ok = torch.isfinite(loss).all()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok  # accumulates over micro-batches
        self._losses.append(loss)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params]
        norms: torch.Tensor | None = None
        flags = []
        if grads:
            per_param = _compat.foreach_norm(grads, float("inf"))
            if len({n.dtype for n in per_param}) == 1 and len({n.device for n in per_param}) == 1:
                norms = torch.stack(per_param)
            else:
                norms = torch.stack([n.float().to(per_param[0].device) for n in per_param])
            flags.append(torch.isfinite(norms).all())
        if self._loss_ok is not None:
            flags.append(self._loss_ok.to(flags[0].device) if flags else self._loss_ok)
        loss_ok, self._loss_ok = self._loss_ok, None
        losses, self._losses = self._losses, []
        if not flags:
            return
        bad = (~torch.stack(flags).all()).to(torch.float32)
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce(bad, reduce_op="sum")
        is_bad = bool(bad.item() > 0)  # the one host sync per optimizer step
        uses_scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        self._skip[id(optimizer)] = is_bad
        if not is_bad:
            self.consecutive = 0
        else:
            self.bad_steps += 1
            self.consecutive += 1
            self.last_bad_params = self._bad_names(params, norms)
            loss_note = ""
            if loss_ok is not None and not bool(loss_ok):
                first = next(x for x in losses if not torch.isfinite(x).all())
                loss_note = f"loss {first.float().flatten()[:1].item()}; "
            where = (
                f"non-finite gradients in {', '.join(self.last_bad_params)}"
                if self.last_bad_params
                else "finite gradients on this rank (another rank or the loss was not)"
            )
            action = "the GradScaler skips it and lowers its scale" if uses_scaler else "skipped"
            if self.consecutive >= self.max_consecutive:
                raise RuntimeError(
                    f"NonFiniteGuard: {self.consecutive} consecutive optimizer steps (up to global step "
                    f"{trainer.global_step}) had a non-finite loss or gradients ({loss_note}{where}). Training "
                    "stopped; none of these steps was applied to the weights. Try a lower learning rate, "
                    "gradient_clip_val, AutoMixedPrecision(dtype='bf16') or fp32_modules=[...] for the layers "
                    "named above, a lower init_scale with fp16, or check the data of these batches."
                )
            rank_zero_warn(
                f"NonFiniteGuard: step {trainer.global_step}: {loss_note}{where}; {action} "
                f"({self.consecutive} in a row, stopping at {self.max_consecutive})"
            )
        pl_module.log("nonfinite/bad_steps", float(self.bad_steps), on_step=True, on_epoch=False, batch_size=1)
        pl_module.log(
            "nonfinite/skipped_steps",
            float(self.skipped_steps + (is_bad and not uses_scaler)),
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    def _bad_names(self, params: list[torch.nn.Parameter], norms: torch.Tensor | None) -> list[str]:
        if norms is None:
            return []
        idx = (~torch.isfinite(norms)).nonzero().flatten()[: self.max_names].tolist()
        return [self._names.get(id(params[i]), f"<param {i}>") for i in idx]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.log_amp_stats or trainer.global_step % max(trainer.log_every_n_steps, 1) != 0:
            return
        plugin = trainer.precision_plugin
        values: dict[str, float] = {}
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            values["amp/loss_scale"] = float(scaler.get_scale())
        for attr in ("skipped_steps", "total_steps"):
            value = getattr(plugin, attr, None)
            if isinstance(value, int):
                values[f"amp/{attr}"] = float(value)
        for key, value in values.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------ checkpoints
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps, "consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.bad_steps = int(state_dict.get("bad_steps", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))
