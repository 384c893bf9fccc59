"""The DeepSpeed ZeRO presets as data, and what is computed from them alone: a preset's config with overrides
merged in, and the first preset whose memory estimate fits.

No Lightning here: the strategies that run a preset are in :mod:`.deepspeed_presets`. See docs/techniques/zero.md.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

from lightning_accel.core.memory import ZeroMemoryEstimate, estimate_zero_memory

__all__ = ["NVME_PATH_ENV", "PRESETS", "choose_zero_preset", "preset_config"]

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
