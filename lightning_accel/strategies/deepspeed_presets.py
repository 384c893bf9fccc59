"""DeepSpeed ZeRO strategies that run on CUDA *and* on CPU, and ``deepspeed_auto``, which picks a preset by memory.

Strings (after ``import lightning_accel``): ``deepspeed_zero1`` ... ``deepspeed_zero3_offload_nvme``, ``deepspeed_auto``.
The presets themselves are data, in :mod:`.zero_presets`. See docs/techniques/zero.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel._imports import require
from lightning_accel.core.memory import count_model_params
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork
from lightning_accel.strategies.zero_presets import (
    NVME_PATH_ENV,
    PRESETS,
    _check_nvme_path,
    choose_zero_preset,
    preset_config,
)

_compat.require_versions("the DeepSpeed strategies")

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "NVME_PATH_ENV",
    "PRESETS",
    "DeepSpeedAutoStrategy",
    "DeepSpeedZeroStrategy",
    "choose_zero_preset",
    "deepspeed_auto",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero2_offload",
    "deepspeed_zero3",
    "deepspeed_zero3_offload",
    "deepspeed_zero3_offload_nvme",
    "preset_config",
]

# DeepSpeedStrategy arguments that build its default config; a preset passes its own config, so these would be
# silently ignored: refuse them and point to `overrides`.
_CONFIG_BUILDING_ARGS = (
    "zero_optimization",
    "stage",
    "offload_optimizer",
    "offload_parameters",
    "offload_params_device",
    "params_buffer_count",
    "params_buffer_size",
    "max_in_cpu",
    "offload_optimizer_device",
    "optimizer_buffer_count",
    "block_size",
    "queue_depth",
    "single_submit",
    "overlap_events",
    "thread_count",
    "pin_memory",
    "sub_group_size",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "allgather_bucket_size",
    "reduce_bucket_size",
    "zero_allow_untested_optimizer",
    "logging_batch_size_per_gpu",
    "config",
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
)


def _cpu_requested(accelerator: Any) -> bool:
    if isinstance(accelerator, CPUAccelerator) or accelerator == "cpu":
        return True
    if accelerator is None:
        return not torch.cuda.is_available()
    return False


class DeepSpeedZeroStrategy(FinishesOutstandingWork, DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` with a ZeRO preset, on CUDA or CPU.

    =====================  =====  ================  ================  ================================================
    preset / string        stage  optimizer states  parameters        use when
    =====================  =====  ================  ================  ================================================
    ``deepspeed_zero1``    1      sharded           replicated        Adam states don't fit; same traffic as DDP
    ``deepspeed_zero2``    2      + gradients       replicated        still tight; same traffic as DDP
    ``deepspeed_zero2_``   2      on CPU            replicated        GPU memory is the limit, host RAM is plenty;
    ``offload``                                                       CPU Adam step (DeepSpeedCPUAdam)
    ``deepspeed_zero3``    3      sharded           sharded           the fp16 weights themselves don't fit; 1.5x
                                                                      DDP traffic
    ``deepspeed_zero3_``   3      on CPU            on CPU            largest models on few GPUs; slowest
    ``offload``
    ``deepspeed_zero3_``   3      on NVMe           on NVMe           beyond host RAM (needs ``nvme_path``, libaio)
    ``offload_nvme``
    =====================  =====  ================  ================  ================================================

    All presets turn on ``overlap_comm`` and ``contiguous_gradients`` and use DeepSpeed's documented bucket sizes
    (see :data:`PRESETS`). ``overrides`` merges into the preset (:func:`preset_config`). Other keyword arguments go
    to ``DeepSpeedStrategy`` (``accelerator``, ``logging_level``, ``load_full_weights``, ``process_group_backend``,
    loss-scaling arguments, ...); its config-building arguments (``stage``, ``offload_*``, bucket sizes, ``config``)
    are refused — put them in ``overrides``.

    On CPU (see docs/techniques/zero.md) every preset but NVMe runs over gloo with the LightningModule's optimizer;
    offload saves nothing there.

    Args:
        preset: a key of :data:`PRESETS`.
        overrides: DeepSpeed config keys merged into the preset.
        nvme_path: NVMe directory (``zero3_offload_nvme`` only; default: ``$LIGHTNING_ACCEL_NVME_PATH``); must
            exist and be writable, checked when the strategy is built.
    """

    def __init__(
        self,
        *,
        preset: str,
        overrides: Mapping[str, Any] | None = None,
        nvme_path: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        refused = sorted(set(kwargs) & set(_CONFIG_BUILDING_ARGS))
        if refused:
            raise ValueError(
                f"deepspeed_{preset}: {', '.join(refused)} would be ignored by a preset; set them as "
                "DeepSpeed config keys in overrides={'zero_optimization': {...}}"
            )
        if preset not in PRESETS:
            raise ValueError(f"unknown DeepSpeed preset {preset!r}; use one of {', '.join(PRESETS)}")
        if PRESETS[preset][1] == "nvme":
            nvme_path = _check_nvme_path(nvme_path if nvme_path is not None else os.environ.get(NVME_PATH_ENV), preset)
        elif nvme_path is not None:
            raise ValueError(f"deepspeed_{preset}: nvme_path is only used by zero3_offload_nvme")
        config = preset_config(preset, overrides, nvme_path=nvme_path)
        # DeepSpeed fixes its accelerator at import; on CPU it must be told before (docs/techniques/zero.md).
        if _cpu_requested(kwargs.get("accelerator")):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        require("deepspeed", f"strategy 'deepspeed_{preset}'")
        super().__init__(config=config, **kwargs)
        self.preset = preset
        self.overrides = dict(overrides or {})
        self.nvme_path = nvme_path

    # --- CPU support: the three CUDA assumptions of Lightning 2.6.6's DeepSpeedStrategy ---------------------------
    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def _prepare_for_device(self) -> None:
        """Check DeepSpeed's accelerator and ops for this device, and adapt the config to a CPU accelerator.

        Raises before training: a DeepSpeed accelerator that is not the Trainer's, or NVMe offload without
        DeepSpeed's ``async_io`` op (libaio).
        """
        from deepspeed.accelerator import get_accelerator

        ds_device = get_accelerator().device_name()
        if self._on_cpu and ds_device != "cpu":
            raise RuntimeError(
                f"deepspeed_{self.preset} on CPU: deepspeed was imported with its {ds_device!r} accelerator. Set "
                "DS_ACCELERATOR=cpu in the environment before Python starts (or build the strategy with "
                "accelerator=CPUAccelerator() before anything imports deepspeed)."
            )
        if not self._on_cpu and ds_device == "cpu":
            raise RuntimeError(
                f"deepspeed_{self.preset} on {type(self.accelerator).__name__}: deepspeed was imported "
                "with its CPU accelerator (DS_ACCELERATOR=cpu?); unset DS_ACCELERATOR to train on GPUs"
            )
        assert isinstance(self.config, dict)
        zero = self.config.get("zero_optimization", {})
        offloads = {
            s: zero[s].get("device")
            for s in ("offload_optimizer", "offload_param")
            if isinstance(zero.get(s), dict) and zero[s].get("device") not in (None, "none")
        }
        if "nvme" in offloads.values():
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise RuntimeError(
                    f"deepspeed_{self.preset}: NVMe offload needs DeepSpeed's async_io op, which cannot be built "
                    "here (it needs libaio: `apt install libaio-dev`, then reinstall deepspeed or let it JIT-build "
                    "the op). Without it, use deepspeed_zero3_offload (CPU offload) instead."
                )
        if self._on_cpu and offloads:
            # On a CPU accelerator the "offloaded" optimizer step runs on the CPU anyway, so the LightningModule's
            # torch optimizer is the right one; DeepSpeed would otherwise insist on DeepSpeedCPUAdam (a JIT-built
            # op). An explicit zero_force_ds_cpu_optimizer in the overrides wins.
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    @override
    def setup_environment(self) -> None:
        if not self._on_cpu:
            super().setup_environment()
            self._prepare_for_device()
            return
        self._prepare_for_device()
        # Lightning 2.6.6 DeepSpeedStrategy.setup_environment raises unless the accelerator is CUDAAccelerator;
        # skip that check only (DDPStrategy.setup_environment: accelerator device setup + setup_distributed).
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if not self._on_cpu:
            super().setup_distributed()
            return
        # Lightning 2.6.6 DeepSpeedStrategy.setup_distributed validates CUDA device indices (CPU devices have
        # none); the rest is unchanged.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        _compat.init_deepspeed_distributed(self)

    def _cpu_device_rank(self) -> int | None:
        """``device_rank`` for ``deepspeed.initialize``.

        Lightning 2.6.6 passes ``root_device.index``, which is None on CPU; DeepSpeed's engine compares it with 0
        (``_set_distributed_vars``). On CPU the local rank is the right value (DeepSpeed's CPU accelerator maps
        every index to "cpu").
        """
        return self.local_rank if self._on_cpu else self.root_device.index

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        # same as Lightning 2.6.6, with device_rank from _cpu_device_rank
        import argparse

        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._cpu_device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Any) -> None:
        if not self._on_cpu:
            super()._initialize_deepspeed_inference(model)
            return
        # same as Lightning 2.6.6, with device_rank from _cpu_device_rank
        import argparse

        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config.update(
                zero_allow_untested_optimizer=self.config["zero_allow_untested_optimizer"],
                zero_optimization=self.config["zero_optimization"],
            )
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._cpu_device_rank()),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )


class DeepSpeedAutoStrategy(DeepSpeedZeroStrategy):
    """``deepspeed_auto``: at setup, the lowest ZeRO stage/offload whose estimated memory fits the device.

    The model's parameters are counted (tied ones once) when the Trainer sets up, and :func:`choose_zero_preset`
    runs on rank 0 with :func:`~lightning_accel.core.memory.estimate_zero_memory`; the choice is broadcast so all
    ranks agree, and logged with every candidate's estimate. Bytes per parameter follow the precision: mixed or
    half precision → 2-byte parameters and gradients; ``32-true`` → 4-byte ones. K = 12 in both (Adam moments plus
    an fp32 master partition, which DeepSpeed's ZeRO-1/2 optimizer keeps even in fp32 training — it clones
    ``single_partition_of_fp32_groups`` — so 12 is exact there and 4 B/param/N conservative at ZeRO-3, which
    reuses an fp32 parameter partition). Pass ``optimizer_bytes_per_param`` for other optimizers.

    Capacity: ``device_memory_bytes`` if given, else the CUDA device's total memory; on CPU the machine's RAM
    divided by the local processes. Host capacity (for offload): the machine's RAM divided by the local processes.

    With ZeRO-3 chosen, the model was not built inside ``deepspeed.zero.Init`` (the choice needs the model);
    DeepSpeed partitions it at ``deepspeed.initialize`` instead, so the full model must fit in memory once.

    Args:
        device_memory_bytes: capacity of one device in bytes (default: detected).
        margin: fraction of the capacity kept free (default 0.2).
        activation_bytes_per_sample: activation bytes per sample, if known (adds ``× micro_batch_size``).
        micro_batch_size: per-device batch for the activation term.
        optimizer_bytes_per_param: K (default: by precision, see above).
        nvme_path: allow ``zero3_offload_nvme`` as the last resort.
        overrides: merged into whichever preset is chosen.
        **kwargs: passed to :class:`DeepSpeedZeroStrategy`.

    After setup, :attr:`decision` holds the chosen preset, the capacity and every candidate's estimate.
    """

    def __init__(
        self,
        *,
        device_memory_bytes: float | None = None,
        margin: float = 0.2,
        activation_bytes_per_sample: float = 0,
        micro_batch_size: int = 0,
        optimizer_bytes_per_param: float | None = None,
        nvme_path: str | os.PathLike[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if device_memory_bytes is not None and (
            not isinstance(device_memory_bytes, (int, float)) or device_memory_bytes <= 0
        ):
            raise ValueError(f"deepspeed_auto: device_memory_bytes={device_memory_bytes!r} must be > 0 bytes")
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"deepspeed_auto: margin={margin!r} must be in [0, 1), e.g. 0.2 (keep 20 % free)")
        if nvme_path is not None:
            nvme_path = _check_nvme_path(nvme_path, "auto")
        # start from zero1 (the cheapest); setup replaces the config with the chosen preset
        super().__init__(preset="zero1", overrides=overrides, **kwargs)
        self.preset = "auto"
        self.nvme_path = nvme_path
        self._auto = {
            "device_memory_bytes": device_memory_bytes,
            "margin": float(margin),
            "activation_bytes_per_sample": activation_bytes_per_sample,
            "micro_batch_size": micro_batch_size,
            "optimizer_bytes_per_param": optimizer_bytes_per_param,
        }
        self.decision: dict[str, Any] | None = None

    def _capacities(self) -> tuple[float, float]:
        import psutil

        local = max(1, self.num_processes)
        host = psutil.virtual_memory().total / local
        device = self._auto["device_memory_bytes"]
        if device is None:
            device = host if self._on_cpu else torch.cuda.get_device_properties(self.root_device).total_memory
        return float(device), float(host)

    def _bytes_per_param(self) -> dict[str, float]:
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        half = precision.startswith(("16", "bf16"))
        k = self._auto["optimizer_bytes_per_param"]
        return {
            "param_bytes": 2 if half else 4,
            "grad_bytes": 2 if half else 4,
            "optimizer_bytes_per_param": k if k is not None else 12,
        }

    def decide(self, model: torch.nn.Module) -> dict[str, Any]:
        """Choose the preset for ``model`` on this run's devices (rank 0 decides; the choice is broadcast)."""
        trainable, frozen = count_model_params(model)
        device_cap, host_cap = self._capacities()
        preset, report = choose_zero_preset(
            trainable,
            self.world_size,
            device_cap,
            margin=self._auto["margin"],
            host_capacity_bytes=host_cap,
            on_cpu=self._on_cpu,
            nvme=self.nvme_path is not None,
            num_frozen_params=frozen,
            activation_bytes_per_sample=self._auto["activation_bytes_per_sample"],
            micro_batch_size=self._auto["micro_batch_size"],
            **self._bytes_per_param(),
        )
        return {
            "preset": preset,
            "num_params": trainable,
            "num_frozen_params": frozen,
            "device_capacity_bytes": device_cap,
            "host_capacity_bytes": host_cap,
            "margin": self._auto["margin"],
            "candidates": [{"preset": p, "fits": f, **e.as_dict()} for p, e, f in report],
        }

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        decision: Any = None
        error: str | None = None
        if self.is_global_zero:
            try:
                decision = self.decide(self.model)
            except ValueError as err:
                error = str(err)
        decision, error = self.broadcast((decision, error))
        if error is not None:
            raise ValueError(error)
        self.decision = decision
        lines = "\n".join(
            f"  {c['preset']:<20} device {c['device_total'] / 1e9:8.3f} GB  host "
            f"{c['host_total'] / 1e9:8.3f} GB  {'fits' if c['fits'] else 'too big'}"
            for c in decision["candidates"]
        )
        rank_zero_info(
            f"deepspeed_auto: chose deepspeed_{decision['preset']} for {decision['num_params']:,} "
            f"trainable parameters on {self.world_size} device(s): budget "
            f"{(1 - decision['margin']) * decision['device_capacity_bytes'] / 1e9:.3f} GB per device "
            f"({decision['device_capacity_bytes'] / 1e9:.3f} GB less a {decision['margin']:.0%} margin)"
            f"\n{lines}"
        )
        self.preset = decision["preset"]
        self.config = preset_config(self.preset, self.overrides, nvme_path=self.nvme_path)
        self._config_initialized = False  # re-format (batch size, precision) for the new config
        super().setup(trainer)


def deepspeed_zero1(**kwargs: Any) -> DeepSpeedZeroStrategy:
    """``strategy="deepspeed_zero1"``: optimizer states sharded."""
    return DeepSpeedZeroStrategy(preset="zero1", **kwargs)


def deepspeed_zero2(**kwargs: Any) -> DeepSpeedZeroStrategy:
    """``strategy="deepspeed_zero2"``: optimizer states and gradients sharded."""
    return DeepSpeedZeroStrategy(preset="zero2", **kwargs)


def deepspeed_zero2_offload(**kwargs: Any) -> DeepSpeedZeroStrategy:
    """``strategy="deepspeed_zero2_offload"``: ZeRO-2 with the optimizer (states and step) on the CPU."""
    return DeepSpeedZeroStrategy(preset="zero2_offload", **kwargs)


def deepspeed_zero3(**kwargs: Any) -> DeepSpeedZeroStrategy:
    """``strategy="deepspeed_zero3"``: optimizer states, gradients and parameters sharded."""
    return DeepSpeedZeroStrategy(preset="zero3", **kwargs)


def deepspeed_zero3_offload(**kwargs: Any) -> DeepSpeedZeroStrategy:
    """``strategy="deepspeed_zero3_offload"``: ZeRO-3 with optimizer and parameters on the CPU."""
    return DeepSpeedZeroStrategy(preset="zero3_offload", **kwargs)


def deepspeed_zero3_offload_nvme(**kwargs: Any) -> DeepSpeedZeroStrategy:
    """``strategy="deepspeed_zero3_offload_nvme"``: ZeRO-3 offloading to ``nvme_path`` (needs libaio)."""
    return DeepSpeedZeroStrategy(preset="zero3_offload_nvme", **kwargs)


def deepspeed_auto(**kwargs: Any) -> DeepSpeedAutoStrategy:
    """``strategy="deepspeed_auto"``: the lowest ZeRO stage/offload whose estimated memory fits (at setup)."""
    return DeepSpeedAutoStrategy(**kwargs)
