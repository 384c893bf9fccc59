"""lightning-accel: PyTorch Lightning plugins that make training fast and show why it is slow.

Public names are imported lazily (PEP 562), so ``import lightning_accel`` stays light: it imports no optional
dependency (deepspeed, DALI, NVML, matplotlib), does not touch CUDA, and only registers the strategy strings
(``Trainer(strategy="ddp_powersgd")``) with Lightning's ``StrategyRegistry``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # callbacks
    "Autopilot": "lightning_accel.callbacks.autopilot",
    "Intervention": "lightning_accel.callbacks.autopilot.fixes",
    "AutopilotPlan": "lightning_accel.core.autopilot",
    "Tolerance": "lightning_accel.core.autopilot",
    "MFUMonitor": "lightning_accel.callbacks.mfu_monitor",
    "BottleneckDoctor": "lightning_accel.callbacks.doctor.bottleneck_doctor",
    "NonFiniteGuard": "lightning_accel.callbacks.non_finite_guard",
    "TorchCompile": "lightning_accel.callbacks.torch_compile",
    "ActivationCheckpointing": "lightning_accel.callbacks.activation_checkpointing",
    "NsysCapture": "lightning_accel.callbacks.nsys_capture",
    # precision
    "AutoMixedPrecision": "lightning_accel.precision.auto_mixed_precision",
    "Float8Training": "lightning_accel.precision.float8",
    # checkpoint IO
    "OrderedAsyncCheckpointIO": "lightning_accel.checkpoint_io",
    # data
    "DALIImageDataModule": "lightning_accel.data.dali",
    "MemmapDataModule": "lightning_accel.data.memmap",
    "MemmapDataset": "lightning_accel.data.memmap",
    "TokenMemmapDataset": "lightning_accel.data.memmap",
    "pack_memmap": "lightning_accel.data.memmap",
    "pack_webdataset": "lightning_accel.data.webdataset",
    "BatchSizeTuner": "lightning_accel.callbacks.batch_size_tuner",
    "DataLoaderTuner": "lightning_accel.callbacks.dataloader_tuner",
    "DevicePrefetcher": "lightning_accel.callbacks.device_prefetcher",
    "ProfileWindow": "lightning_accel.callbacks.profile_window",
    # attention fast paths
    "SDPABackendRecorder": "lightning_accel.attention",
    "sdpa_backends": "lightning_accel.attention",
    "use_fused_attention": "lightning_accel.attention",
    # losses
    "LinearCrossEntropy": "lightning_accel.losses",
    "linear_cross_entropy": "lightning_accel.losses",
    "use_fused_linear_cross_entropy": "lightning_accel.losses",
    # core
    "count_flops": "lightning_accel.core.flops",
    "transformer_flops_per_token": "lightning_accel.core.flops",
    "get_peak_flops": "lightning_accel.core.peak",
    "measure_peak_flops": "lightning_accel.core.peak",
    "DoctorReport": "lightning_accel.core.report",
    "Thresholds": "lightning_accel.core.rules",
    "diagnose": "lightning_accel.core.rules",
    "timed_comm_hook": "lightning_accel.core.comm",
    "nvtx_range": "lightning_accel.core.nvtx",
    "find_batch_size": "lightning_accel.core.batch_size_search",
    "estimate_zero_memory": "lightning_accel.core.memory",
    "project_scaling": "lightning_accel.core.scaling",
    # scale-out
    "AutoParallelStrategy": "lightning_accel.strategies.model_parallel",
    "derive_plan": "lightning_accel.strategies.parallel_plan",
    "finish_outstanding_work": "lightning_accel.strategies.outstanding_work",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


from lightning_accel.strategies.registration import register_strategies  # noqa: E402

register_strategies()
