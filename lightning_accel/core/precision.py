"""Mixed-precision building blocks without Lightning: which autocast dtype a device supports and runs fastest
(:func:`choose_autocast_dtype`), and fp32 "islands" (modules that run with autocast off).

On CUDA the hardware decides (bf16 where it is native, else fp16 with a scaler); on a CPU a half dtype is used only
where a short probe measures it faster than fp32. See docs/techniques/mixed-precision.md.
"""

from __future__ import annotations

import fnmatch
import functools
import statistics
import time
import types
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accel._compat import autocast_enabled, tree_map
from lightning_accel.core.checkpointing import clean_module_name

__all__ = [
    "AUTOCAST_DTYPES",
    "CPU_MIN_SPEEDUP",
    "DtypeChoice",
    "Fp32Islands",
    "autocast_speedup",
    "choose_autocast_dtype",
    "cpu_has_native_bf16",
    "supported_autocast_dtypes",
]

#: names accepted for the autocast dtype -> torch dtype
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: on CPU, a half-precision dtype must beat fp32 by this factor on the probe to be chosen (guards against noise)
CPU_MIN_SPEEDUP = 1.10

_PROBE_CACHE: dict[tuple[str, int, str], float] = {}

#: CPU feature flags (``/proc/cpuinfo``) of bf16 matrix multiplies in hardware: x86's AVX512-BF16 and AMX-BF16
#: (Cooper Lake, Sapphire Rapids and newer, Zen 4 and newer), Arm's BF16 extension
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (:data:`NATIVE_BF16_FLAGS` among the flags of
    ``/proc/cpuinfo``, or of ``cpuinfo`` when given); ``False`` where there is no such file (not Linux). Without
    them oneDNN emulates bf16 and autocast is many times slower than fp32; with them bf16 autocast takes 1.2-1.6x
    off the GPT-2 and Llama steps of benchmarks/bench_autopilot_real.py on a 2-core AVX512-BF16 CPU."""
    if cpuinfo is None:
        return _this_cpu_has_native_bf16()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and NATIVE_BF16_FLAGS & set(value.split()):
            return True
    return False


@functools.cache
def _this_cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            return cpu_has_native_bf16(fh.read())
    except OSError:
        return False


def supported_autocast_dtypes(device: torch.device | str) -> list[str]:
    """The autocast dtypes (``"bf16"``, ``"fp16"``) ``device`` supports; ``[]`` if it has no autocast.

    CUDA: fp16 always, bf16 only in hardware (compute capability >= 8.0, or ROCm); bf16 emulation on older GPUs is
    not counted as support because it is slower than fp32. Other device types: what ``torch.autocast`` accepts.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return []
        bf16 = torch.version.hip is not None or torch.cuda.get_device_capability(device)[0] >= 8
        return ["bf16", "fp16"] if bf16 else ["fp16"]
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return []
    out = []
    for name, dtype in AUTOCAST_DTYPES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns "target dtype is not supported. Disabling autocast"
            ctx = torch.autocast(device.type, dtype=dtype)
        if autocast_enabled(ctx):
            out.append(name)
    return out


def autocast_speedup(
    device: torch.device | str, dtype: str, *, size: int = 256, chain: int = 4, repeats: int = 5, budget_s: float = 0.5
) -> float:
    """fp32 time ÷ autocast-``dtype`` time of a matmul chain on ``device`` (> 1 means autocast is faster).

    The probe multiplies ``chain`` fp32 ``size``×``size`` matrices in sequence, once in fp32 and once under
    ``torch.autocast(dtype)`` (which casts the inputs, as in training), alternating the two ``repeats`` times and
    comparing medians. A dtype that is more than 4× slower than fp32 on its first timed run is not timed further,
    and the whole probe stops after about ``budget_s`` seconds. Cached per (device, threads, dtype).
    """
    device = torch.device(device)
    key = (str(device), torch.get_num_threads(), dtype)
    if key in _PROBE_CACHE:
        return _PROBE_CACHE[key]
    fast = AUTOCAST_DTYPES[dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    mats = [torch.randn(size, size, generator=gen).to(device) for _ in range(chain + 1)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(enabled: bool) -> float:
        sync()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, dtype=fast, enabled=enabled):
            out = mats[0]
            for m in mats[1:]:
                out = out @ m
        sync()
        return time.perf_counter() - start

    run(False)
    run(True)  # warm-up: kernels, allocator
    fp32_times, amp_times = [], []
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        fp32_times.append(run(False))
        amp_times.append(run(True))
        if amp_times[-1] > 4 * fp32_times[-1] or time.perf_counter() > deadline:
            break
    speedup = statistics.median(fp32_times) / max(statistics.median(amp_times), 1e-12)
    _PROBE_CACHE[key] = speedup
    return speedup


@dataclass(frozen=True)
class DtypeChoice:
    """What :func:`choose_autocast_dtype` decided and why."""

    dtype: torch.dtype  #: the autocast dtype, or ``torch.float32`` for "stay in fp32"
    reason: str
    speedups: dict[str, float] = field(default_factory=dict)  #: CPU probe results: dtype name -> fp32 time ÷ its time

    @property
    def needs_scaler(self) -> bool:
        return self.dtype == torch.float16


def choose_autocast_dtype(device: torch.device | str, requested: str = "auto") -> DtypeChoice:
    """Resolve ``requested`` ("auto", "bf16", "fp16", "fp32") for ``device`` following the rule of
    docs/techniques/mixed-precision.md.

    Raises:
        ValueError: an explicit dtype the device does not support; the message lists what it supports.
    """
    device = torch.device(device)
    if requested == "fp32":
        return DtypeChoice(torch.float32, "fp32 requested")
    supported = supported_autocast_dtypes(device)
    if requested in AUTOCAST_DTYPES:
        if requested not in supported:
            what = ", ".join(supported) if supported else "no autocast dtype"
            name = (
                torch.cuda.get_device_name(device)
                if device.type == "cuda" and torch.cuda.is_available()
                else device.type
            )
            raise ValueError(
                f"AutoMixedPrecision(dtype={requested!r}): {name} supports {what} (plus 'fp32'); "
                f"use dtype='auto' to pick the best supported one"
            )
        return DtypeChoice(AUTOCAST_DTYPES[requested], f"{requested} requested")
    if requested != "auto":
        raise ValueError(f"AutoMixedPrecision(dtype={requested!r}): use 'auto', 'bf16', 'fp16' or 'fp32'")
    if not supported:
        return DtypeChoice(torch.float32, f"{device.type} has no autocast; staying in fp32")
    if device.type == "cuda":
        if "bf16" in supported:
            return DtypeChoice(torch.bfloat16, "CUDA GPU with hardware bf16")
        return DtypeChoice(torch.float16, "CUDA GPU without hardware bf16: fp16 with a GradScaler")
    if device.type != "cpu":
        name = "bf16" if "bf16" in supported else "fp16"
        return DtypeChoice(AUTOCAST_DTYPES[name], f"{device.type}: {name} is supported")
    speedups = {name: autocast_speedup(device, name) for name in supported}
    best = max(speedups, key=lambda n: speedups[n])
    if "bf16" in speedups and speedups["bf16"] * CPU_MIN_SPEEDUP >= speedups[best]:
        best = "bf16"  # within 10 % of the fastest: prefer bf16, which needs no GradScaler
    measured = ", ".join(f"{n} {s:.2f}x" for n, s in speedups.items())
    if speedups[best] < CPU_MIN_SPEEDUP:
        return DtypeChoice(
            torch.float32,
            f"CPU probe: no autocast dtype is >= {CPU_MIN_SPEEDUP:.2f}x faster "
            f"than fp32 ({measured} of fp32 speed); staying in fp32",
            speedups,
        )
    return DtypeChoice(
        AUTOCAST_DTYPES[best], f"CPU probe: {best} is {speedups[best]:.2f}x fp32 speed ({measured})", speedups
    )


# ---------------------------------------------------------------------------------------------- fp32 islands
def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


_ISLAND_ATTR = "_fp32_island"  # instance attribute: (autocast device type, the forward it replaced or None)


def _island_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    device_type, inner = getattr(self, _ISLAND_ATTR)
    with torch.autocast(device_type, enabled=False):  # a `with` block: torch.compile traces it without a break
        args, kwargs = tree_map(_to_fp32, (args, kwargs))
        out = inner(*args, **kwargs) if inner is not None else type(self).forward(self, *args, **kwargs)
    return tree_map(_to_fp32, out)


class Fp32Islands:
    """Run chosen submodules in fp32 inside an autocast region: autocast off, floating inputs and outputs fp32.

    Matching: a ``type`` entry matches modules that are instances of it; a string entry is an ``fnmatch`` pattern
    over the qualified module names of ``model.named_modules()`` (``"*.ln_f"``, ``"head"``, ``"blocks.*.attn"``;
    matched without the segments wrappers add, such as activation checkpointing's ``_checkpoint_wrapped_module``).
    Each matched module gets an instance-level ``forward`` that runs the class's ``forward`` inside
    ``torch.autocast(device_type, enabled=False)`` with half-precision inputs upcast and outputs in fp32. The
    module tree, hooks and ``state_dict`` keys are unchanged; ``copy.deepcopy`` carries the island to the copy;
    ``torch.compile`` traces the ``with`` block (hooks that enter autocast by hand would break the graph).

    Args:
        model: the module tree to search.
        targets: module types and/or name patterns.
        device_type: the autocast device type to disable (``"cuda"``, ``"cpu"``, ...).

    Attributes:
        names: qualified names of the matched modules.
        unmatched: the entries of ``targets`` that matched nothing.
    """

    def __init__(self, model: nn.Module, targets: Sequence[type | str], device_type: str) -> None:
        self.device_type = device_type
        self.names: list[str] = []
        self.unmatched: list[type | str] = []
        self._modules: list[nn.Module] = []
        hits: dict[int, int] = {i: 0 for i in range(len(targets))}
        for name, module in model.named_modules():
            found = False
            for i, target in enumerate(targets):
                if (isinstance(target, type) and isinstance(module, target)) or (
                    isinstance(target, str) and name and fnmatch.fnmatchcase(clean_module_name(name), target)
                ):
                    hits[i] += 1
                    found = True
            if found and not hasattr(module, _ISLAND_ATTR):  # nested islands are harmless; each is set once
                setattr(module, _ISLAND_ATTR, (device_type, vars(module).get("forward")))
                module.forward = types.MethodType(_island_forward, module)
                self._modules.append(module)
                self.names.append(clean_module_name(name) or "<root>")
        self.unmatched = [targets[i] for i, n in hits.items() if n == 0]

    def remove(self) -> None:
        """Restore the modules' own ``forward``: they run under the surrounding autocast again."""
        for module in self._modules:
            _, inner = vars(module).pop(_ISLAND_ATTR)
            if inner is not None:
                module.forward = inner
            else:
                vars(module).pop("forward", None)
        self._modules.clear()
        self.names.clear()

    @staticmethod
    def describe(targets: Iterable[type | str]) -> str:
        return ", ".join(t.__name__ if isinstance(t, type) else repr(t) for t in targets)
