"""DeepSpeed ZeRO presets that run on CUDA *and* on CPU, and ``deepspeed_auto``, which picks one by memory.

Strings (after ``import lightning_accel``): ``deepspeed_zero1``, ``deepspeed_zero2``, ``deepspeed_zero2_offload``,
``deepspeed_zero3``, ``deepspeed_zero3_offload``, ``deepspeed_zero3_offload_nvme``, ``deepspeed_auto``.

Lightning's ``DeepSpeedStrategy`` refuses CPUs, though DeepSpeed runs ZeRO on CPU with its CPU accelerator
(``DS_ACCELERATOR=cpu``) over gloo. :class:`DeepSpeedZeroStrategy` lifts Lightning's three CUDA assumptions (see
:meth:`DeepSpeedZeroStrategy._cpu_device_rank` and the two ``setup_*`` overrides). DeepSpeed picks its
accelerator once, when it is first imported: the strategy sets ``DS_ACCELERATOR=cpu`` (``os.environ.setdefault``,
so an explicit value wins) before importing deepspeed when it is built with a CPU accelerator or on a machine
without CUDA. On a CUDA machine, to train on CPU with a strategy *string*, export ``DS_ACCELERATOR=cpu`` first (the
string's factory cannot see ``Trainer(accelerator=...)``), or pass ``DeepSpeedZeroStrategy(preset=...,
accelerator=CPUAccelerator())``; a mismatch is reported before training starts.

What runs on CPU (DeepSpeed 0.19, checked by ``tests/strategies/test_deepspeed_presets.py``): ZeRO stages 1, 2
and 3, and the CPU-offload presets, with the LightningModule's own torch optimizer (for offload presets the
strategy sets ``zero_force_ds_cpu_optimizer: False`` on CPU, since the step runs on the CPU anyway;
``DeepSpeedCPUAdam`` also works once DeepSpeed has JIT-built its ``cpu_adam`` op). On a CPU accelerator the
offload presets save no memory — the states already live in host memory — so they are for testing a GPU
configuration on a laptop or CI. NVMe offload needs DeepSpeed's ``async_io`` op (libaio) on any device; without it
the strategy raises before training. On CUDA every preset is DeepSpeed's usual configuration.
"""

from __future__ import annotations

import copy
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
from lightning_accel.core.memory import ZeroMemoryEstimate, count_model_params, estimate_zero_memory
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork

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

# Bucket sizes and flags from DeepSpeed's config documentation (https://www.deepspeed.ai/docs/config-json/,
# "ZeRO optimizations") and its ZeRO tutorial (https://www.deepspeed.ai/tutorials/zero/): 5e8-element
# all-gather/reduce buckets for stages 1-2, overlap_comm + contiguous_gradients on; stage 3 with DeepSpeed's
# documented stage-3 defaults (prefetch bucket 5e7, persistence threshold 1e5, live parameters / reuse distance 1e9,
# sub-group 1e9) and a 5e8 reduce bucket.
_STAGE12 = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000,
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
}
_STAGE3 = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": True,
}
#: environment variable read for ``nvme_path`` when the string ``deepspeed_zero3_offload_nvme`` is used
NVME_PATH_ENV = "LIGHTNING_ACCEL_NVME_PATH"

_OFFLOAD_CPU = {"device": "cpu", "pin_memory": True}

#: preset -> (ZeRO stage, optimizer offload, parameter offload, zero_optimization section)
PRESETS: dict[str, tuple[int, str | None, str | None, dict[str, Any]]] = {
    "zero1": (1, None, None, {"stage": 1, **_STAGE12}),
    "zero2": (2, None, None, {"stage": 2, **_STAGE12}),
    "zero2_offload": (2, "cpu", None, {"stage": 2, **_STAGE12, "offload_optimizer": dict(_OFFLOAD_CPU)}),
    "zero3": (3, None, None, {"stage": 3, **_STAGE3}),
    "zero3_offload": (
        3,
        "cpu",
        "cpu",
        {"stage": 3, **_STAGE3, "offload_optimizer": dict(_OFFLOAD_CPU), "offload_param": dict(_OFFLOAD_CPU)},
    ),
    # buffer_count/buffer_size from DeepSpeed's ZeRO-Infinity docs (offload_param: 5 buffers of 1e8 elements;
    # offload_optimizer: 4 buffers, >= Adam's states per parameter)
    "zero3_offload_nvme": (
        3,
        "nvme",
        "nvme",
        {
            "stage": 3,
            **_STAGE3,
            "offload_optimizer": {"device": "nvme", "nvme_path": None, "pin_memory": True, "buffer_count": 4},
            "offload_param": {
                "device": "nvme",
                "nvme_path": None,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 100_000_000,
                "max_in_cpu": 1_000_000_000,
            },
        },
    ),
}

# Top-level DeepSpeed sections a user may add to a preset (https://www.deepspeed.ai/docs/config-json/); Lightning
# fills train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping and fp16/bf16 itself.
_EXTRA_TOP_LEVEL = (
    "bf16",
    "fp16",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "flops_profiler",
    "comms_logger",
    "activation_checkpointing",
    "aio",
    "zero_force_ds_cpu_optimizer",
    "train_micro_batch_size_per_gpu",
    "optimizer",
    "scheduler",
    "data_types",
    "checkpoint",
    "memory_breakdown",
    "dump_state",
)

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


def _zero_config_keys() -> set[str]:
    """Valid ``zero_optimization`` keys: DeepSpeed's own schema (fields and their aliases)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    keys: set[str] = set()
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _merge(base: dict[str, Any], overrides: Mapping[str, Any], path: str, valid: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        allowed = valid.get("__keys__") if isinstance(valid, dict) else None
        if allowed is not None and key not in allowed:
            where = f"{path}." if path else ""
            raise ValueError(
                f"unknown DeepSpeed preset key {where}{key!r}; valid keys{' in ' + path if path else ''}:"
                f" {', '.join(sorted(allowed))}"
            )
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, f"{path}.{key}" if path else key, valid.get(key, {}))
        else:
            base[key] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else value


def preset_config(
    preset: str, overrides: Mapping[str, Any] | None = None, *, nvme_path: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """The DeepSpeed config dict of ``preset`` with ``overrides`` merged in (nested dicts merge key by key).

    Args:
        preset: a key of :data:`PRESETS` (``"zero1"`` ... ``"zero3_offload_nvme"``).
        overrides: e.g. ``{"zero_optimization": {"reduce_bucket_size": 2e8}}``. Top-level keys: the preset's
            own plus common DeepSpeed sections (``bf16``, ``fp16``, ``gradient_clipping``, ``aio``, ...);
            ``zero_optimization`` keys: those of DeepSpeed's ``DeepSpeedZeroConfig``.
        nvme_path: the NVMe directory for ``zero3_offload_nvme``.

    Raises:
        ValueError: unknown preset or key (the message lists the valid ones).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown DeepSpeed preset {preset!r}; use one of {', '.join(PRESETS)}")
    zero = copy.deepcopy(PRESETS[preset][3])
    for section in ("offload_optimizer", "offload_param"):
        if section in zero and zero[section]["device"] == "nvme":
            zero[section]["nvme_path"] = None if nvme_path is None else os.fspath(nvme_path)
    config: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if overrides:
        if not isinstance(overrides, Mapping):
            raise ValueError(f"overrides must be a dict of DeepSpeed config keys, got {type(overrides).__name__}")
        zero_keys = _zero_config_keys()
        valid = {"__keys__": set(config) | set(_EXTRA_TOP_LEVEL), "zero_optimization": {"__keys__": zero_keys}}
        _merge(config, overrides, "", valid)
    return config


def _check_nvme_path(nvme_path: Any, preset: str) -> str:
    if nvme_path is None:
        raise ValueError(
            f"deepspeed_{preset} needs nvme_path=<directory on an NVMe drive>: pass "
            "DeepSpeedZeroStrategy(preset='zero3_offload_nvme', nvme_path='/local_nvme') or set "
            f"{NVME_PATH_ENV}=/local_nvme for the strategy string"
        )
    path = os.fspath(nvme_path)
    if not os.path.isdir(path):
        raise ValueError(
            f"deepspeed_{preset}: nvme_path {path!r} does not exist or is not a directory; create it "
            "on the NVMe drive first"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"deepspeed_{preset}: nvme_path {path!r} is not writable by this user; pick a writable "
            "directory on the NVMe drive"
        )
    return path


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

    On CPU (see the module docstring) every preset but NVMe runs over gloo with the LightningModule's optimizer;
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
        # DeepSpeed fixes its accelerator at import; on CPU it must be told before (see module docstring).
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


def choose_zero_preset(
    num_params: int,
    num_devices: int,
    capacity_bytes: float,
    *,
    margin: float = 0.2,
    host_capacity_bytes: float | None = None,
    on_cpu: bool = False,
    nvme: bool = False,
    **estimate_kwargs: Any,
) -> tuple[str, list[tuple[str, ZeroMemoryEstimate, bool]]]:
    """The first preset (zero1, zero2, zero2_offload, zero3, zero3_offload, zero3_offload_nvme) whose estimate fits.

    A preset fits when its per-device bytes are at most ``(1 - margin) × capacity_bytes`` and its host bytes per
    rank at most ``(1 - margin) × host_capacity_bytes`` (when given). The margin leaves room for what
    :func:`~lightning_accel.core.memory.estimate_zero_memory` does not model (buckets, prefetch buffers,
    fragmentation); 0.2 follows the method's "stay under ~80 % of the device". On CPU the "device" is host memory:
    offload presets are not candidates (they move nothing there) and device and host bytes add up.

    Returns:
        ``(chosen preset, [(preset, estimate, fits), ...])`` for every candidate considered, in order.

    Raises:
        ValueError: if nothing fits; the message lists each candidate's need against the budget.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"deepspeed_auto: margin={margin!r} must be in [0, 1), e.g. 0.2 (keep 20 % free)")
    budget = (1 - margin) * capacity_bytes
    host_budget = None if host_capacity_bytes is None else (1 - margin) * host_capacity_bytes
    report: list[tuple[str, ZeroMemoryEstimate, bool]] = []
    for preset, (stage, opt, par, _) in PRESETS.items():
        if (on_cpu and (opt or par)) or (opt == "nvme" and not nvme):
            continue
        est = estimate_zero_memory(
            num_params, num_devices, stage, offload_optimizer=opt, offload_params=par, **estimate_kwargs
        )
        need = est.device_total + (est.host_total if on_cpu else 0.0)
        fits = need <= budget and (on_cpu or host_budget is None or est.host_total <= host_budget)
        report.append((preset, est, fits))
        if fits:
            return preset, report
    lines = "; ".join(
        f"{p}: device {e.device_total / 1e9:.2f} GB, host {e.host_total / 1e9:.2f} GB" for p, e, _ in report
    )
    raise ValueError(
        f"deepspeed_auto: no ZeRO preset fits {num_params:,} parameters on {num_devices} device(s) "
        f"with {capacity_bytes / 1e9:.2f} GB each (budget {budget / 1e9:.2f} GB after a {margin:.0%} "
        f"margin): {lines}. Use more devices, a smaller model or micro-batch, activation "
        f"checkpointing{', or NVMe offload (nvme_path=...)' if not nvme and not on_cpu else ''}."
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
