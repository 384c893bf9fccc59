"""The fixes the Autopilot can apply and undo, each built on the existing component that implements it.

An :class:`Intervention` is one machine-applicable change: ``unavailable(run)`` says why it cannot apply (or
``None``), ``apply(run)`` changes the run in place and returns its :class:`~lightning_accel.core.autopilot_search.Undo`
(built-ins implement ``change(run, undo)``, pushing the undo of each part as they make it, so an apply that raises
halfway leaves nothing applied; ``revert(run)`` runs the last undo), ``describe(run)`` names the change
for the table, ``config(run)`` gives its LightningCLI keys and Python lines, and ``params`` are what a plan stores to
replay it. ``kind`` decides the numerics tolerance (``lightning_accel.core.autopilot.NUMERICS_KINDS``) and
``knobs`` the user settings it touches (``Autopilot(freeze=[...])`` names them).

============================  ===========================================  ==============================  =============
name                          change                                       built on                        kind
============================  ===========================================  ==============================  =============
``dataloader``                num_workers / prefetch_factor /              ``DataLoaderTuner``'s search    data
                              persistent_workers
``pin_memory``                pin_memory=True (CUDA)                       the DataLoader                  data
``prefetch``                  background prefetch (+ side-stream copies)   ``DevicePrefetcher``            data
``micro_batch``               micro-batch ×f, accumulation ÷f (global      ``BatchSizeTuner``'s attribute  reorder
                              batch fixed)                                 lookup
``optimizer_fused``           ``fused=True`` optimizer step                torch.optim                     reorder
``optimizer_foreach``         ``foreach=True`` optimizer step              torch.optim                     exact
``precision``                 bf16 (fp16 + scaler where bf16 is missing)   ``AutoMixedPrecision``,         low_precision
                              from Lightning's default ``32-true``, or     installed by the Autopilot
                              another dtype of the user's plugin
``tf32``                      TF32 matmuls for a run that stays fp32       ``torch.set_float32_matmul_``   reorder
                              (CUDA, compute capability >= 8.0)            ``precision("high")``
``compile``                   torch.compile in place (pays back or not)    ``TorchCompile``                reorder
``fused_attention``           hand-written attention → SDPA                ``use_fused_attention``         reorder
``activation_checkpointing``    recompute blocks + larger micro-batch        ``core.checkpointing``          reorder
``compression``               16-bit gradient all-reduce (DDP), or         ``ddp_bf16_compress``'s hook    low_precision
                              Top-K / QSGD where ``project_scaling``       (``ddp_topk`` / ``ddp_qsgd``'s
                              ranks them ahead for the link and ranks      hooks)
============================  ===========================================  ==============================  =============
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_accel.callbacks._autopilot_trials import RunConfig, TrialRunner, Window
    from lightning_accel.callbacks._loader_source import TrainLoaderSource

from lightning_accel.core.autopilot_search import Undo

__all__ = ["COMPRESSION_STRATEGIES", "INTERVENTIONS", "Intervention", "Run", "choose_compression"]


@dataclass
class Run:
    """What an intervention may look at and change."""

    trainer: pl.Trainer
    module: pl.LightningModule
    source: TrainLoaderSource
    config: RunConfig
    runner: TrialRunner
    baseline: Window | None = None
    current: Window | None = None
    steps_left: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.trainer.strategy.root_device


class Intervention:
    """Base class of the Autopilot's fixes (see the module docstring). Subclasses may be passed to
    ``Autopilot(interventions=[...])`` to trial fixes of your own with the same protocol and numerics guard."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "exact"
    knobs: ClassVar[tuple[str, ...]] = ()
    #: estimated extra warm-up steps the change needs (compilation)
    warmup_steps: ClassVar[int] = 0
    #: after being kept, a fresh instance may be trialled again (a micro-batch doubled once more)
    repeatable: ClassVar[bool] = False
    #: the numerics probe runs through the strategy's wrapper (DDP), with collectives (communication changes)
    probe_through_strategy: ClassVar[bool] = False

    def __init__(self, **params: Any) -> None:
        self.params = dict(params)

    def unavailable(self, run: Run) -> str | None:
        return None

    def apply(self, run: Run) -> Undo:
        """Make the change and return its undo. If :meth:`change` raises, what it did so far is undone first."""
        undo = Undo()
        try:
            self.change(run, undo)
        except BaseException as err:
            try:
                undo()
            except BaseException as undo_err:  # noqa: BLE001 - the original error is the one to see
                err.add_note(f"undoing the partial {self.name} change also raised {undo_err!r}")
            raise
        self._undo = undo
        return undo

    def change(self, run: Run, undo: Undo) -> None:
        """Make the change, pushing onto ``undo`` the undo of each part as it is made (or override ``apply`` and
        ``revert`` instead, as fixes written for earlier versions do)."""
        raise NotImplementedError(f"{type(self).__name__}: implement change(run, undo), or apply(run) and revert(run)")

    def revert(self, run: Run) -> None:
        """Undo the last :meth:`apply` (nothing if it is undone already)."""
        undo = self.__dict__.pop("_undo", None)
        if undo is not None:
            undo()

    def describe(self, run: Run) -> str:
        return self.name

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return [], []

    def changed_nothing(self, run: Run) -> str | None:
        """Asked after the numerics probe ran training steps with the change: why it turned out to change nothing
        (it is then rejected without being measured), or ``None``."""
        return None

    def judge(self, run: Run, before: Window, after: Window) -> tuple[bool, str] | None:
        """An extra condition for keeping the change once it measured faster (``None``: none)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"


# ------------------------------------------------------------------------------------------------ data
class DataLoaderSettings(Intervention):
    """More loader workers: the cheapest setting that feeds the measured step, found by DataLoaderTuner's search
    (``choose_loader_setting``) over 0, 1, 2, 4, … workers × prefetch 2 and 4 with persistent workers."""

    name = "dataloader"
    kind = "data"
    knobs = ("num_workers", "prefetch_factor", "persistent_workers")

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.callbacks.dataloader_tuner import default_worker_counts
        from lightning_accel.core.utilisation import usable_cores_per_rank

        if self.params:
            return None
        current = run.source.current()["num_workers"]
        if max(default_worker_counts(usable_cores_per_rank(run.trainer.num_devices))) <= current:
            return f"num_workers={current} already uses every core of this rank"
        return None

    def _choose(self, run: Run) -> dict[str, Any]:
        from lightning_accel.callbacks.dataloader_tuner import (
            LoaderSetting,
            choose_loader_setting,
            default_worker_counts,
            loader_batches_per_sec,
        )
        from lightning_accel.core.utilisation import usable_cores_per_rank

        window = run.current or run.baseline
        assert window is not None
        # the rate the loader must sustain: steps/s of everything but the data wait
        busy = max(window.step_seconds - window.stage_seconds.get("data", 0.0) / max(window.steps, 1), 1e-9)
        consumption = run.config.accumulate / busy  # batches/s
        current = run.source.current()
        counts = [w for w in default_worker_counts(usable_cores_per_rank(run.trainer.num_devices))
                  if w > current["num_workers"]]
        if not counts:
            raise ValueError(f"no worker count above the current {current['num_workers']} fits this rank's cores")
        grid = [LoaderSetting(w, pf, True, bool(current["pin_memory"])) for w in counts for pf in (2, 4)]

        def measure(setting: LoaderSetting) -> float:
            values = {"num_workers": setting.num_workers, "prefetch_factor": setting.prefetch_factor,
                      "persistent_workers": True}
            loader = run.source.build(values)
            run.runner.state.track_loader(loader)
            try:
                return loader_batches_per_sec(loader, 2, 20, setting.num_workers, setting.prefetch_factor)
            finally:
                run.runner.state.restore()

        index, _ = choose_loader_setting(grid, measure, consumption, margin=0.2)
        chosen = grid[index]
        return {"num_workers": chosen.num_workers, "prefetch_factor": chosen.prefetch_factor,
                "persistent_workers": True}

    def change(self, run: Run, undo: Undo) -> None:
        if not self.params:
            self.params = self._choose(run)
        before = {k: run.source.current()[k] for k in self.params}
        undo.push(lambda: run.source.set(before))
        run.source.set(self.params)

    def describe(self, run: Run) -> str:
        p = self.params
        if not p:
            return "DataLoader workers (searched)"
        return f"num_workers={p['num_workers']}, prefetch_factor={p['prefetch_factor']}, persistent_workers=True"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return run.source.config_entries()


class PinMemory(Intervention):
    """``pin_memory=True``: page-locked host batches, so the host→device copy is a DMA that can overlap."""

    name = "pin_memory"
    kind = "data"
    knobs = ("pin_memory",)

    def unavailable(self, run: Run) -> str | None:
        if run.device.type != "cuda":
            return "pinned memory only speeds host-to-GPU copies; this run is on " + run.device.type
        if run.source.current()["pin_memory"]:
            return "the loader already pins memory"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        before = run.source.current()["pin_memory"]
        undo.push(lambda: run.source.set({"pin_memory": before}))
        run.source.set({"pin_memory": True})

    def describe(self, run: Run) -> str:
        return "pin_memory=True"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return run.source.config_entries()


class Prefetch(Intervention):
    """``DevicePrefetcher``: batches fetched ahead in a thread (on CUDA pinned and copied on a side stream)."""

    name = "prefetch"
    kind = "data"
    knobs = ("prefetch",)

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher

        if run.config.prefetch or any(isinstance(cb, DevicePrefetcher) for cb in run.trainer.callbacks):
            return "DevicePrefetcher is already in use"
        if run.device.type not in ("cpu", "cuda"):
            return f"no prefetching on {run.device.type}"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        before = run.config.prefetch
        undo.push(lambda: setattr(run.config, "prefetch", before))
        run.config.prefetch = True

    def describe(self, run: Run) -> str:
        return "DevicePrefetcher (batches fetched ahead in a thread)"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return ([("trainer.callbacks", [{"class_path": "lightning_accel.DevicePrefetcher"}])],
                ["callbacks.append(la.DevicePrefetcher())"])


# ------------------------------------------------------------------------------------------------ batch
def _smallest_factor(n: int) -> int:
    for f in range(2, n + 1):
        if n % f == 0:
            return f
    return 1


class MicroBatch(Intervention):
    """A larger micro-batch with the global batch held fixed (Composer's rule): micro-batch ×f and
    ``accumulate_grad_batches`` ÷f, so every optimizer step sees the same samples; only possible with
    accumulation > 1. The learning rate needs no change."""

    name = "micro_batch"
    kind = "reorder"
    knobs = ("batch_size", "accumulate_grad_batches")
    repeatable = True

    def unavailable(self, run: Run) -> str | None:
        accumulate = run.config.accumulate
        if accumulate <= 1:
            return ("accumulate_grad_batches is 1: a larger micro-batch would change the global batch (and the "
                    "training); use BatchSizeTuner(target_global_batch_size=...) to trade it for accumulation")
        if not run.module.automatic_optimization:
            return "manual optimization: the LightningModule does its own accumulation"
        reason = run.source.can_set("batch_size")
        if reason:
            return reason
        if not run.source.current().get("batch_size"):
            return "the loader's batch size is unknown"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        current = run.source.current()
        if not self.params:
            factor = _smallest_factor(run.config.accumulate)
            self.params = {"batch_size": int(current["batch_size"]) * factor,
                           "accumulate_grad_batches": run.config.accumulate // factor}
        global_before = int(current["batch_size"]) * run.config.accumulate
        global_after = self.params["batch_size"] * self.params["accumulate_grad_batches"]
        if global_before != global_after:
            raise ValueError(f"micro_batch {self.params} changes the global batch per device from {global_before} "
                             f"to {global_after}; the plan was made for another batch size or accumulation")
        batch_size, accumulate = current["batch_size"], run.config.accumulate
        undo.push(lambda: run.source.set({"batch_size": batch_size}))
        run.source.set({"batch_size": self.params["batch_size"]})
        undo.push(lambda: setattr(run.config, "accumulate", accumulate))
        run.config.accumulate = self.params["accumulate_grad_batches"]

    def describe(self, run: Run) -> str:
        p = self.params
        if not p:
            return "larger micro-batch, same global batch"
        return (f"batch_size={p['batch_size']} × accumulate_grad_batches={p['accumulate_grad_batches']} "
                "(same global batch)")

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        yaml, python = run.source.config_entries()
        yaml = [e for e in yaml if e[0].endswith(".batch_size")]
        python = [line for line in python if "batch_size" in line]
        acc = run.config.accumulate  # the final value (a repeated micro-batch change supersedes this one's)
        return ([*yaml, ("trainer.accumulate_grad_batches", acc)],
                [*python, f"trainer_kwargs['accumulate_grad_batches'] = {acc}"])


# ------------------------------------------------------------------------------------------------ optimizer
class OptimizerImplementation(Intervention):
    """The multi-tensor (``foreach``) or single-kernel (``fused``) implementation of the optimizer step, set in
    every param group of every optimizer (torch.optim reads the flags at each step)."""

    kind = "exact"
    knobs = ("optimizer",)
    flag: ClassVar[str] = ""

    def unavailable(self, run: Run) -> str | None:
        if not run.trainer.optimizers:
            return "no optimizer"
        for opt in run.trainer.optimizers:
            if self.flag not in opt.defaults:
                return f"{type(opt).__name__} has no `{self.flag}` implementation"
            if all(g.get(self.flag) is True for g in opt.param_groups):
                return f"{type(opt).__name__} already runs with {self.flag}=True"
            if self.flag == "foreach" and all(g.get("fused") is True for g in opt.param_groups):
                return f"{type(opt).__name__} already runs its fused step (one kernel for all tensors)"
        if self.flag == "fused":
            devices = {p.device.type for opt in run.trainer.optimizers for g in opt.param_groups for p in g["params"]}
            from lightning_accel._compat import fused_optimizer_devices

            unsupported = devices - set(fused_optimizer_devices())
            if unsupported:
                return f"no fused optimizer kernels on {sorted(unsupported)}"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        for opt in run.trainer.optimizers:
            saved = [_flags(d) for d in (opt.defaults, *opt.param_groups)]
            undo.push(lambda opt=opt, saved=saved: [_set_flags(d, f) for d, f in
                                                    zip((opt.defaults, *opt.param_groups), saved)])
            for group in opt.param_groups:
                if self.flag == "fused":
                    group["fused"] = True
                    if "foreach" in group:
                        group["foreach"] = False
                else:
                    group["foreach"] = True
                    if "fused" in group:
                        group["fused"] = False if group["fused"] else group["fused"]
            opt.defaults[self.flag] = True

    def describe(self, run: Run) -> str:
        names = sorted({type(o).__name__ for o in run.trainer.optimizers})
        return f"{'/'.join(names)}({self.flag}=True)"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        names = sorted({type(o).__name__ for o in run.trainer.optimizers})
        line = f"# in configure_optimizers: torch.optim.{names[0]}(..., {self.flag}=True)"
        return [], [line]


def _flags(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in ("foreach", "fused") if k in d}


def _set_flags(d: dict[str, Any], saved: dict[str, Any]) -> None:
    for k in ("foreach", "fused"):
        if k in saved:
            d[k] = saved[k]
        else:
            d.pop(k, None)


class FusedOptimizer(OptimizerImplementation):
    __doc__ = OptimizerImplementation.__doc__
    name = "optimizer_fused"
    kind = "reorder"
    flag = "fused"


class ForeachOptimizer(OptimizerImplementation):
    __doc__ = OptimizerImplementation.__doc__
    name = "optimizer_foreach"
    kind = "exact"
    flag = "foreach"


# ------------------------------------------------------------------------------------------------ compute
class MixedPrecisionDtype(Intervention):
    """Mixed precision chosen by the whole step, not a matmul probe.

    * With Lightning's default ``32-true`` (the plain ``Precision`` plugin): installs ``AutoMixedPrecision`` itself
      with bf16 where the device has it, else fp16 with its ``GradScaler`` (the playbook's defaults); autocast
      keeps its fp32 op list (softmax, norms, losses) in fp32, and the ``low_precision`` numerics guard checks the
      loss and gradient direction on the probe batches. The plan, YAML and Python snippet carry the plugin.
    * With ``AutoMixedPrecision`` already in ``plugins=``: another dtype (fp32 -> bf16/fp16, or back to fp32 when
      its micro-probe chose a half dtype).

    ``Autopilot(freeze=["precision"])`` opts out. Other precision plugins (the user's own choice) are left alone.
    """

    name = "precision"
    kind = "low_precision"
    knobs = ("precision",)

    @staticmethod
    def _plugin(run: Run) -> Any:
        from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

        plugin = run.trainer.precision_plugin
        return plugin if isinstance(plugin, AutoMixedPrecision) else None

    @staticmethod
    def _default(run: Run) -> bool:
        from lightning.pytorch.plugins.precision import Precision

        return type(run.trainer.precision_plugin) is Precision  # Lightning's 32-true

    def _target(self, run: Run) -> str | None:
        from lightning_accel.core.precision import supported_autocast_dtypes

        plugin = self._plugin(run)
        if plugin is None:
            current = "fp32"
        else:
            current = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(plugin.compute_dtype, "fp32")
        if "dtype" in self.params:
            return self.params["dtype"] if self.params["dtype"] != current else None
        if current != "fp32":
            return "fp32"
        supported = supported_autocast_dtypes(run.device)
        return "bf16" if "bf16" in supported else ("fp16" if "fp16" in supported else None)

    def unavailable(self, run: Run) -> str | None:
        if self._plugin(run) is None and not self._default(run):
            return (f"the run's precision plugin is {type(run.trainer.precision_plugin).__name__} (the user's "
                    "choice); use Lightning's default or plugins=[la.AutoMixedPrecision()] to let the Autopilot "
                    "choose the dtype")
        if self._target(run) is None:
            return "no other autocast dtype on this device"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.core.precision import DtypeChoice, choose_autocast_dtype
        from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

        target = self._target(run)
        if target is None:
            raise ValueError(f"precision: dtype {self.params.get('dtype')!r} is what the run already computes in")
        self.params = {"dtype": target}
        strategy = run.trainer.strategy
        plugin = self._plugin(run)
        if plugin is None:  # Lightning's default: install the plugin (undo puts the user's back)
            original = strategy.precision_plugin
            plugin = AutoMixedPrecision(dtype=target)

            def uninstall() -> None:
                plugin.remove_islands()
                strategy.precision_plugin = original

            undo.push(uninstall)
            strategy.precision_plugin = plugin
            plugin.convert_module(run.module)
            return
        saved = (plugin.choice, plugin.precision, plugin.scaler)
        undo.push(lambda: (setattr(plugin, "choice", saved[0]), setattr(plugin, "precision", saved[1]),
                           setattr(plugin, "scaler", saved[2])))
        choice = choose_autocast_dtype(run.device, target)
        plugin.choice = DtypeChoice(choice.dtype, f"{target}: measured faster end to end by the Autopilot")
        plugin.precision = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(choice.dtype, "32-true")
        plugin.scaler = torch.amp.GradScaler(run.device.type, **plugin.scaler_kwargs) if choice.needs_scaler \
            else None

    def describe(self, run: Run) -> str:
        if "dtype" not in self.params:
            return ("AutoMixedPrecision (bf16, fp16 + scaler without bf16)" if self._plugin(run) is None
                    else "another AutoMixedPrecision dtype")
        return f"AutoMixedPrecision(dtype={self.params['dtype']!r})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        dtype = self.params["dtype"]
        return ([("trainer.plugins", [{"class_path": "lightning_accel.AutoMixedPrecision",
                                       "init_args": {"dtype": dtype}}])],
                [f"plugins = [la.AutoMixedPrecision(dtype={dtype!r})]"])


class Tf32Matmul(Intervention):
    """TF32 tensor-core matmuls (``torch.set_float32_matmul_precision("high")``) for a run that stays in fp32 on a
    CUDA GPU of compute capability >= 8.0: 10 mantissa bits in the products, fp32 accumulation (the doctor's
    ``tf32_off`` smell). Kind ``reorder``: the numbers move at the level of a reordered sum."""

    name = "tf32"
    kind = "reorder"
    knobs = ("precision",)

    def unavailable(self, run: Run) -> str | None:
        if run.device.type != "cuda":
            return f"TF32 is a mode of CUDA tensor cores; this run is on {run.device.type}"
        major = torch.cuda.get_device_capability(run.device)[0]
        if major < 8:
            return f"compute capability {major}.x has no TF32 (needs >= 8.0)"
        plugin = run.trainer.precision_plugin
        dtype = getattr(plugin, "compute_dtype", None)
        precision = str(getattr(plugin, "precision", "32"))
        if dtype in (torch.bfloat16, torch.float16) or precision.startswith(("16", "bf16")):
            return "the run computes its matmuls in 16 bits"
        if torch.get_float32_matmul_precision() != "highest":
            return f"float32 matmul precision is already {torch.get_float32_matmul_precision()!r}"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        before = torch.get_float32_matmul_precision()
        undo.push(lambda: torch.set_float32_matmul_precision(before))
        torch.set_float32_matmul_precision("high")

    def describe(self, run: Run) -> str:
        return 'torch.set_float32_matmul_precision("high") (TF32 matmuls)'

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return [], ['torch.set_float32_matmul_precision("high")  # TF32 matmuls, before building the Trainer']


#: the playbook's upper end of torch.compile's gain on compute-heavy models ("typically 10-30 %")
MAX_COMPILE_GAIN = 0.30
#: seconds a first inductor compile of a small model typically takes (CPU: C++ codegen on few cores; CUDA: triton);
#: used only to skip a trial that could not pay back even at MAX_COMPILE_GAIN — a real trial measures its own
TYPICAL_COMPILE_SECONDS = {False: 30.0, True: 20.0}


class Compile(Intervention):
    """``TorchCompile``: the model's children compiled in place. Kept only if the time it saves over the steps left
    in the fit exceeds the compile time measured in the trial's warm-up."""

    name = "compile"
    kind = "reorder"
    knobs = ("compile",)
    warmup_steps = 3

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.callbacks.torch_compile import TorchCompile

        if any(isinstance(cb, TorchCompile) for cb in run.trainer.callbacks):
            return "TorchCompile is already in use"
        from lightning_accel._compat import compiled_call

        if any(compiled_call(m) is not None for m in run.module.modules()):
            return "the model is already compiled"
        window = run.current or run.baseline
        if run.steps_left is not None and window is not None and "backend" not in self.params:
            # even the playbook's best case (30 % faster steps) cannot repay a typical first compile in this fit
            saved = MAX_COMPILE_GAIN * window.step_seconds * run.steps_left
            if saved < TYPICAL_COMPILE_SECONDS[run.device.type == "cuda"]:
                return (f"cannot pay back: the {run.steps_left} steps left take ~{window.step_seconds * run.steps_left:.0f} s, "
                        f"so even {MAX_COMPILE_GAIN:.0%} faster steps save ~{saved:.0f} s, less than a typical "
                        f"first compile (~{TYPICAL_COMPILE_SECONDS[run.device.type == 'cuda']:.0f} s)")
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.callbacks.torch_compile import TorchCompile

        callback = self._callback = TorchCompile(**self.params)
        undo.push(callback.uncompile)  # uncompiles whatever setup compiled, also if it raised halfway
        callback.setup(run.trainer, run.module, "fit")
        if callback.fallback_reason:
            raise RuntimeError(callback.fallback_reason)

    def judge(self, run: Run, before: Window, after: Window) -> tuple[bool, str] | None:
        from lightning_accel.core.autopilot import compile_pays_back

        if self._callback.fallback_reason:
            return False, self._callback.fallback_reason
        # the trial's first window warmed up with the compile: its warm-up time beyond that of compiled steps
        warmup_steps = run.extras.get("warmup_steps", 0) + self.warmup_steps
        compile_seconds = max(0.0, after.warmup_seconds - warmup_steps * after.step_seconds)
        return compile_pays_back(compile_seconds, before.step_seconds, after.step_seconds, run.steps_left)

    def describe(self, run: Run) -> str:
        return "TorchCompile()" if not self.params else f"TorchCompile({self.params})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        entry: dict[str, Any] = {"class_path": "lightning_accel.TorchCompile"}
        if self.params:
            entry["init_args"] = dict(self.params)
        return [("trainer.callbacks", [entry])], ["callbacks.append(la.TorchCompile())"]


def _attention_blocks(model: nn.Module) -> list[str]:
    """Innermost modules that look like hand-written attention (class name contains "Attention", or the name ends
    in attn/attention), excluding ``nn.MultiheadAttention`` (switched only with a probe of its weights' use)."""
    names = []
    for name, module in model.named_modules():
        if not name or isinstance(module, nn.MultiheadAttention):
            continue
        last = name.rsplit(".", 1)[-1].lower()
        if "attention" in type(module).__name__.lower() or last in ("attn", "attention", "self_attn", "self_attention"):
            names.append(name)
    return [n for n in names if not any(o != n and o.startswith(n + ".") for o in names)]


class FusedAttention(Intervention):
    """``use_fused_attention``: Hugging Face models on eager attention switch to the library's SDPA path, and the
    hand-written ``softmax(q @ k.T) @ v`` of other attention blocks runs as one ``F.scaled_dot_product_attention``
    call. Rejected without measuring when the probe's steps fused nothing (the attention already calls SDPA)."""

    name = "fused_attention"
    kind = "reorder"
    knobs = ("attention",)

    def unavailable(self, run: Run) -> str | None:
        blocks = self.params.get("blocks") or _attention_blocks(run.module)
        if not blocks:
            return "no hand-written attention block found (modules named *attn / *Attention*)"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.attention import use_fused_attention

        blocks = self.params.get("blocks") or _attention_blocks(run.module)
        self.params = {"blocks": list(blocks)}
        # the table reports what fused and what did not: no warning per block that already calls SDPA
        self._result = use_fused_attention(run.module, blocks=blocks, warn=False)
        undo.push(self._result.restore)

    def changed_nothing(self, run: Run) -> str | None:
        result = self._result
        if result.library or result.mha or sum(result.fused_calls.values()):
            return None
        return "no attention call matched the fused pattern (nothing changed)" + (
            f"; {next(iter(result.not_fired.values()))}" if result.not_fired else "")

    def describe(self, run: Run) -> str:
        result = getattr(self, "_result", None)
        if result is not None and result.library:
            switched = ", ".join(f"{name or 'model'} {before} → sdpa" for name, before in result.library.items())
            return f"use_fused_attention: Hugging Face attn_implementation {switched}"
        blocks = self.params.get("blocks") or []
        shown = ", ".join(blocks[:2]) + (f" +{len(blocks) - 2}" if len(blocks) > 2 else "")
        return f"use_fused_attention({shown or 'attention blocks'})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        line = f"la.use_fused_attention(model, blocks={self.params['blocks']!r})"
        result = getattr(self, "_result", None)
        if result is not None and result.library:  # what it does there: the library's own setting
            line += "  # Hugging Face: the same as building the model with attn_implementation='sdpa'"
        return [], [line]


class ActivationCheckpointingWithLargerBatch(Intervention):
    """Activation checkpointing of the repeated blocks *and* a micro-batch ×f with accumulation ÷f: only when the
    doctor says memory is the limit (peak ≥ 90 % with a small batch) and accumulation leaves room for a larger
    micro-batch — recomputing costs ~20 % more compute, so it only pays through the larger batch."""

    name = "activation_checkpointing"
    kind = "reorder"
    knobs = ("activation_checkpointing", "batch_size", "accumulate_grad_batches")

    def _block_type(self, run: Run) -> type | None:
        counts: collections.Counter[type] = collections.Counter()
        for module in run.module.modules():
            if isinstance(module, nn.ModuleList):
                for child in module:
                    if any(True for _ in child.parameters()):
                        counts[type(child)] += 1
        common = counts.most_common(1)
        return common[0][0] if common and common[0][1] >= 2 else None

    def unavailable(self, run: Run) -> str | None:
        reason = MicroBatch().unavailable(run)
        if reason:
            return reason
        if self._block_type(run) is None:
            return "no repeated block (an nn.ModuleList of 2+ modules of one class) to checkpoint"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.core.checkpointing import (
            CHECKPOINT_PREFIX,
            apply_activation_checkpointing,
            clean_module_name,
            remove_activation_checkpointing,
        )

        def wrappers() -> set[str]:
            return {clean_module_name(n) for n, m in run.module.named_modules() if n and hasattr(m, CHECKPOINT_PREFIX)}

        block = self._block_type(run)
        if block is None:
            raise ValueError("no repeated block (an nn.ModuleList of 2+ modules of one class) to checkpoint")
        self._micro = MicroBatch(**{k: v for k, v in self.params.items() if k != "block"})
        # the micro-batch change's undo goes on the same stack first: if checkpointing raises, it is undone too
        self._micro.change(run, undo)
        self.params = {**self._micro.params, "block": f"{block.__module__}.{block.__qualname__}"}
        already = wrappers()

        def unwrap() -> None:  # every wrapper this change added, also those of a wrap that raised halfway
            added = sorted(wrappers() - already)
            if added:
                remove_activation_checkpointing(run.module, added)

        undo.push(unwrap)
        apply_activation_checkpointing(run.module, [block])

    def describe(self, run: Run) -> str:
        block = self.params.get("block", "blocks").rsplit(".", 1)[-1]
        return f"ActivationCheckpointing({block}) + " + (self._micro.describe(run) if hasattr(self, "_micro")
                                                         else "larger micro-batch")

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        yaml, python = self._micro.config(run)
        block = self.params["block"]
        return ([*yaml, ("trainer.callbacks", [{"class_path": "lightning_accel.ActivationCheckpointing",
                                                "init_args": {"modules": [block]}}])],
                [*python, f"callbacks.append(la.ActivationCheckpointing(modules=[{block.rsplit('.', 1)[-1]}]))"])


# ------------------------------------------------------------------------------------------------ communication
class SwitchableCompression:
    """A DDP comm hook whose compression can change between steps: torch's ``allreduce_hook`` (the plain averaged
    all-reduce), ``bf16_compress_hook``, ``fp16_compress_hook``, or the collection's ``topk_hook`` / ``qsgd_hook``
    (``strategies/compression_hooks.py``, the hooks of ``ddp_topk`` / ``ddp_qsgd`` with those strategies' default
    knobs). DDP accepts one comm hook per model and cannot remove it, so the Autopilot registers this one the first
    time it trials compression and switches it.

    The Top-K / QSGD states start compressing at once (``start_iter=0``: the Autopilot trials after its baseline
    steps, when DDP has rebuilt its buckets, which is what the strategies' 2-step warm-up waits for)."""

    MODES: ClassVar[tuple[str, ...]] = ("allreduce", "bf16", "fp16", "topk", "qsgd")

    def __init__(self) -> None:
        self.mode = "allreduce"
        self._states: dict[str, Any] = {}

    def state(self, mode: str) -> Any:
        """The :class:`~lightning_accel.strategies.compression_hooks.TopKState` / ``QSGDState`` of ``mode``
        (made on first use; ``None`` for the stateless modes)."""
        if mode not in ("topk", "qsgd"):
            return None
        if mode not in self._states:
            from lightning_accel.strategies import compression_hooks as ch

            self._states[mode] = (ch.TopKState(density=0.01, start_iter=0) if mode == "topk"
                                  else ch.QSGDState(levels=7, start_iter=0))
        return self._states[mode]

    def residuals(self) -> dict[str, dict[int, torch.Tensor]]:
        """The error-feedback residuals the stateful modes hold, by mode (what a revert clears)."""
        return {mode: dict(state.error_dict) for mode, state in self._states.items()}

    def clear_residuals(self) -> None:
        """Drop the unsent residuals (a revert: the part of the gradient Top-K has not sent yet is lost)."""
        for state in self._states.values():
            state.error_dict.clear()

    def hook(self) -> Callable[..., Any]:
        """The function to register (DDP checks its signature: no annotations other than torch's own)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from lightning_accel.strategies import compression_hooks as ch

        hooks = {"allreduce": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
                 "fp16": default_hooks.fp16_compress_hook, "topk": ch.topk_hook, "qsgd": ch.qsgd_hook}

        def switchable(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects other annotations
            own = self.state(self.mode)
            return hooks[self.mode](own if own is not None else state, bucket)

        return switchable


#: The strategy string that gives each compression mode by hand (and in a replayed plan).
COMPRESSION_STRATEGIES: dict[str, str] = {"bf16": "ddp_bf16_compress", "fp16": "ddp_fp16_compress",
                                          "topk": "ddp_topk", "qsgd": "ddp_qsgd"}

#: A Top-K / QSGD hook is chosen over bf16 only when the projection puts its step at least this much faster.
MIN_PROJECTED_GAIN = 0.05


def choose_compression(*, n: int, link: Any, params: int, step_s: float) -> tuple[str, str]:
    """The compression mode for ``n`` ranks on ``link`` from ``core.scaling.project_scaling``: ``"topk"`` or
    ``"qsgd"`` where its projected step beats ``ddp_bf16_compress``'s by :data:`MIN_PROJECTED_GAIN` (their
    all-gathered bytes grow with ``n``: they pay on slow links with few ranks), else ``"bf16"``.

    Args:
        n: ranks of the gradient all-reduce.
        link: a :class:`~lightning_accel.core.scaling.Interconnect` or preset name.
        params: gradient entries (fp32) reduced per step.
        step_s: the measured step seconds (the compute that hides the communication).

    Returns:
        ``(mode, why)``: the mode and the projection that chose it, in words.
    """
    from lightning_accel.core.scaling import ScalingWorkload, get_interconnect, project_scaling

    link = get_interconnect(link)
    workload = ScalingWorkload(compute_s=max(step_s, 1e-9), params=max(1, int(params)))
    points = {p.strategy: p for p in project_scaling(workload, link, n=[n],
                                                     strategies=("ddp_bf16_compress", "ddp_topk", "ddp_qsgd"))}
    bf16 = points["ddp_bf16_compress"]
    best = min(("ddp_topk", "ddp_qsgd"), key=lambda s: (points[s].step_s, points[s].comm_s))
    ms = {s: f"{p.step_s * 1e3:.3g}" for s, p in points.items()}
    why = (f"projected step (ms) on {link.name} ({link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} µs), "
           f"{n} ranks: bf16 {ms['ddp_bf16_compress']}, topk {ms['ddp_topk']}, qsgd {ms['ddp_qsgd']}")
    if points[best].step_s < (1 - MIN_PROJECTED_GAIN) * bf16.step_s:
        return best.removeprefix("ddp_"), why
    return "bf16", why


def measure_link(run: Run) -> Any:
    """The run's gradient link, fitted (``core.scaling.fit_interconnect``) from timed all-reduces of 256 KiB and
    4 MiB on its process group, each rank's slowest of 3 taken over all ranks (so every rank chooses alike)."""
    import time

    import torch.distributed as dist

    from lightning_accel.callbacks._trainer import gather_floats
    from lightning_accel.core.scaling import fit_interconnect

    sizes = [256 * 2**10, 4 * 2**20]
    local = []
    for size in sizes:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=run.device)
        dist.all_reduce(buffer)  # warm-up
        times = []
        for _ in range(3):
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            times.append(time.perf_counter() - start)
        local.append(sorted(times)[1])
    rows = gather_floats(run.trainer, run.device, local, what="Autopilot compression link measurement")
    seconds = [float(rows[:, i].max()) for i in range(len(sizes))]
    try:
        return fit_interconnect(sizes, seconds, run.trainer.world_size, name="measured")
    except ValueError:  # times that do not grow with size: latency-bound, call it a fast link
        from lightning_accel.core.scaling import Interconnect

        return Interconnect("measured", 1e12, max(0.0, min(seconds)) / (2 * (run.trainer.world_size - 1)))


class Compression(Intervention):
    """Compressed gradient all-reduce under plain Lightning DDP, trialled when the backward (which includes the
    exposed all-reduce in the Autopilot's trial steps) holds the run back: 16 bits (``ddp_bf16_compress``'s hook),
    or Top-K / QSGD (``ddp_topk`` / ``ddp_qsgd``'s hooks) where ``core.scaling.project_scaling`` puts them ahead
    on the run's link and rank count (:func:`choose_compression`; the link is measured with a few all-reduces
    unless ``interconnect=`` names a preset). The numerics probe runs through the DDP wrapper here, so the
    compressed all-reduce is what it checks (Top-K's error feedback evens out over steps, a one-step probe sees the
    sparse gradient: it refuses a Top-K the tolerance cannot take, and bf16 is trialled next, see
    :meth:`fallback`). If the trial is not kept, the registered hook
    stays as torch's plain averaged all-reduce for the fit (the same sums, reduced in Python instead of DDP's
    built-in reducer): DDP cannot unregister a hook; Top-K's unsent residual is dropped.

    Args:
        compression: ``"bf16"``, ``"fp16"``, ``"topk"`` or ``"qsgd"`` (a replayed plan); default: chosen as above.
        interconnect: a ``core.scaling`` preset name for the choice instead of the measured link.
    """

    name = "compression"
    kind = "low_precision"
    knobs = ("strategy",)
    probe_through_strategy = True

    def __init__(self, **params: Any) -> None:
        mode = params.get("compression")
        if mode is not None and mode not in COMPRESSION_STRATEGIES:
            raise ValueError(f"Compression(compression={mode!r}): use one of {', '.join(COMPRESSION_STRATEGIES)} "
                             "(or leave it out: chosen from the scaling projection)")
        link = params.get("interconnect")
        if link is not None:
            from lightning_accel.core.scaling import get_interconnect

            get_interconnect(link)  # an unknown preset fails here, naming the presets
        super().__init__(**params)
        self.why: str | None = None

    def unavailable(self, run: Run) -> str | None:
        from lightning.pytorch.strategies import DDPStrategy
        from torch.nn.parallel import DistributedDataParallel

        from lightning_accel.strategies.ddp_compression import DDPCompressionStrategy

        if run.trainer.world_size <= 1:
            return "single process: no gradient all-reduce"
        strategy = run.trainer.strategy
        if isinstance(strategy, DDPCompressionStrategy):
            return f"the strategy already compresses ({strategy.compression})"
        if not isinstance(strategy, DDPStrategy) or not isinstance(strategy.model, DistributedDataParallel):
            return f"{type(strategy).__name__} is not plain DDP"
        return None

    def _choose(self, run: Run) -> str:
        link = self.params.get("interconnect") or measure_link(run)
        window = run.current or run.baseline
        step_s = window.step_seconds if window is not None and window.steps else 1e-3
        params = sum(p.numel() for p in run.module.parameters() if p.requires_grad)
        mode, self.why = choose_compression(n=run.trainer.world_size, link=link, params=params, step_s=step_s)
        return mode

    def change(self, run: Run, undo: Undo) -> None:
        switch = run.extras.get("comm_switch")
        if switch is None:
            switch = SwitchableCompression()
            try:
                run.trainer.strategy.model.register_comm_hook(None, switch.hook())
            except RuntimeError as err:
                raise ValueError(f"the DDP model has a comm hook already ({err}); use "
                                 "strategy='ddp_bf16_compress' to compress") from err
            run.extras["comm_switch"] = switch
        mode = self.params.get("compression") or self._choose(run)
        self.params = {"compression": mode}
        before = switch.mode

        def revert() -> None:
            switch.mode = before
            switch.clear_residuals()  # the unsent residual is lost (a lossy change, checked by the probe)

        undo.push(revert)
        switch.mode = mode

    def fallback(self) -> Compression | None:
        """After a trial that was not kept: bf16 where the projection had chosen Top-K / QSGD (its one-step
        gradient is what the probe refuses most often), else nothing."""
        if self.why is not None and self.params.get("compression") in ("topk", "qsgd"):
            return Compression(compression="bf16")
        return None

    def describe(self, run: Run) -> str:
        name = COMPRESSION_STRATEGIES[self.params.get("compression", "bf16")]
        return f"strategy={name!r}" + (f" ({self.why})" if self.why else "")

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        name = COMPRESSION_STRATEGIES[self.params["compression"]]
        return [("trainer.strategy", name)], [f"trainer_kwargs['strategy'] = {name!r}  # after import lightning_accel"]


#: Built-in interventions by name, in the order the table lists them.
INTERVENTIONS: dict[str, Callable[..., Intervention]] = {
    cls.name: cls for cls in (DataLoaderSettings, PinMemory, Prefetch, MicroBatch, FusedOptimizer, ForeachOptimizer,
                              MixedPrecisionDtype, Tf32Matmul, Compile, FusedAttention,
                              ActivationCheckpointingWithLargerBatch, Compression)
}


def knob_names() -> list[str]:
    """Every knob a built-in intervention touches (the valid entries of ``Autopilot(freeze=...)``)."""
    return sorted({k for cls in INTERVENTIONS.values() for k in cls.knobs})  # type: ignore[attr-defined]

