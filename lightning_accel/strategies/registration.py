"""Registers lightning-accel's strategy strings with Lightning's ``StrategyRegistry``.

Each entry maps a string to a *factory* that imports the strategy's module only when a Trainer asks for it, so
``import lightning_accel`` imports no optional dependency (deepspeed) and touches no CUDA. Registration is a dict
insert; it is idempotent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["STRATEGIES", "register_strategies"]

_DDP = "lightning_accel.strategies.ddp_compression"
_DS = "lightning_accel.strategies.deepspeed_presets"
_MP = "lightning_accel.strategies.model_parallel"
_PP = "lightning_accel.strategies.pipeline"

#: name -> (module, factory function in it, description).
STRATEGIES: dict[str, tuple[str, str, str]] = {
    "ddp_fp16_compress": (_DDP, "ddp_fp16_compress", "DDP, gradients all-reduced in fp16 (half the bytes)"),
    "ddp_bf16_compress": (_DDP, "ddp_bf16_compress", "DDP, gradients all-reduced in bf16 (half the bytes)"),
    "ddp_powersgd": (_DDP, "ddp_powersgd", "DDP with PowerSGD low-rank gradient compression"),
    "ddp_topk": (_DDP, "ddp_topk", "DDP with Top-K gradient sparsification (1 %) and error feedback"),
    "ddp_qsgd": (_DDP, "ddp_qsgd", "DDP with QSGD stochastic gradient quantisation (4 bits per entry)"),
    "deepspeed_zero1": (_DS, "deepspeed_zero1", "DeepSpeed ZeRO-1 (optimizer states sharded), CUDA or CPU"),
    "deepspeed_zero2": (_DS, "deepspeed_zero2", "DeepSpeed ZeRO-2 (+ gradients sharded), CUDA or CPU"),
    "deepspeed_zero2_offload": (_DS, "deepspeed_zero2_offload", "DeepSpeed ZeRO-2, optimizer offloaded to CPU"),
    "deepspeed_zero3": (_DS, "deepspeed_zero3", "DeepSpeed ZeRO-3 (+ parameters sharded), CUDA or CPU"),
    "deepspeed_zero3_offload": (
        _DS,
        "deepspeed_zero3_offload",
        "DeepSpeed ZeRO-3, optimizer and parameters offloaded to CPU",
    ),
    "deepspeed_zero3_offload_nvme": (
        _DS,
        "deepspeed_zero3_offload_nvme",
        "DeepSpeed ZeRO-3, optimizer and parameters offloaded to NVMe (nvme_path=...)",
    ),
    "deepspeed_auto": (
        _DS,
        "deepspeed_auto",
        "DeepSpeed with the lowest ZeRO stage/offload whose estimated memory fits the device",
    ),
    "fsdp2": (_MP, "fsdp2", "FSDP2 (fully_shard) over all devices, automatic plan without configure_model"),
    "tp": (_MP, "tp", "tensor parallelism over all devices, automatic plan (HF tp_plan or module structure)"),
    "fsdp2_tp": (_MP, "fsdp2_tp", "tensor parallelism inside the node x FSDP2 across nodes, automatic plan"),
    "pp": (_PP, "pp", "pipeline parallelism: the model's blocks split over the ranks automatically, 1F1B schedule"),
    "pp_ddp": (_PP, "pp_ddp", "pipeline parallelism x data parallelism on a 2-D mesh (stages x replicas)"),
}


#: strings refused with the reason (not registered as strategies: a Trainer given one stops with this error)
REFUSED: dict[str, str] = {
    "pp_fsdp2": (
        "strategy='pp_fsdp2' is not built: the pipeline strategy runs the unsplit network in one process "
        "before the first step (the split check and the loss check), while fully_shard gathers parameters "
        "only through the wrapped module's own forward; it sets the schedule's gradients aside and hands "
        "them back in backward(), sums the tied embedding's gradients across the first and last stage, and "
        "gathers plain tensors into the checkpoint, none of which handles FSDP2's sharded DTensor "
        "parameters and gradients yet. Use strategy='pp_ddp' (stages x data-parallel replicas, "
        "compression= for the replica all-reduce), or 'fsdp2' alone"
    ),
}


def _refusal(name: str) -> Callable[..., Any]:
    def refuse(**kwargs: Any) -> Any:
        raise ValueError(REFUSED[name])

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def _lazy_factory(module: str, factory: str) -> Callable[..., Any]:
    def build(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), factory)(**kwargs)

    build.__name__ = factory
    build.__qualname__ = factory
    return build


def register_strategies() -> list[str]:
    """Insert every string of :data:`STRATEGIES` into ``StrategyRegistry`` (if not there yet); returns the names."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (module, factory, description) in STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _lazy_factory(module, factory), description=description)
    for name in REFUSED:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _refusal(name), description=f"refused: {REFUSED[name][:60]}...")
    return list(STRATEGIES)
