"""Peak FLOP/s of a device: a datasheet table for GPUs, a measured matmul probe for CPUs and unknown devices.

Every table entry is the **dense** figure (NVIDIA datasheets print the 2:4-sparse figure with an asterisk; dense is
half of it). For fp16/bf16/fp8 it is the tensor-core rate with fp32 accumulation where the datasheet tells them
apart (GeForce cards run fp16 with fp16 accumulation at twice the rate; mixed-precision training accumulates in
fp32). A chip without a data type in hardware (bf16 on V100/T4, fp8 before Ada/Hopper) has no entry: ``None``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DTYPE_NAMES",
    "PeakFlops",
    "get_peak_flops",
    "measure_peak_flops",
    "normalize_dtype",
    "resolve_peak_flops",
]

T = 1e12

#: canonical names of the data types the table knows, with the spellings accepted for each
DTYPE_NAMES: dict[str, tuple[Any, ...]] = {
    "fp64": ("fp64", "float64", "double", "64", torch.float64),
    "fp32": ("fp32", "float32", "float", "32", torch.float32),
    "tf32": ("tf32", "tfloat32"),
    "bf16": ("bf16", "bfloat16", torch.bfloat16),
    "fp16": ("fp16", "float16", "half", "16", torch.float16),
    "fp8": ("fp8", "float8", "float8_e4m3fn", "float8_e5m2", torch.float8_e4m3fn, torch.float8_e5m2),
}


def normalize_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` → ``"bf16"``; an unknown one raises ``ValueError``."""
    key = dtype.lower() if isinstance(dtype, str) else dtype
    for name, spellings in DTYPE_NAMES.items():
        if key in spellings:
            return name
    raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)} (or the torch dtype)")


@dataclass(frozen=True)
class _Chip:
    label: str
    source: str
    flops: dict[str, float]


# Dense peaks in FLOP/s. Sources are the vendor datasheets; the sparse (asterisked) figure is halved.
_H100_SXM = _Chip("H100 SXM5", "NVIDIA H100 datasheet (SXM5): FP32 67 TF, TF32 989*, BF16/FP16 1979*, FP8 3958* TF",
                  {"fp64": 34 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
                   "fp8": 1978.9 * T})
_H100_PCIE = _Chip("H100 PCIe", "NVIDIA H100 datasheet (PCIe): FP32 51 TF, TF32 756*, BF16/FP16 1513*, FP8 3026* TF",
                   {"fp64": 26 * T, "fp32": 51.2 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T,
                    "fp8": 1513 * T})
_H100_NVL = _Chip("H100 NVL", "NVIDIA H100 datasheet (NVL, per GPU): FP32 60 TF, TF32 835*, BF16/FP16 1671*, FP8 3341*",
                  {"fp64": 30 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
                   "fp8": 1670.5 * T})
_H200_SXM = _Chip("H200 SXM", "NVIDIA H200 datasheet (SXM): FP32 67 TF, TF32 989*, BF16/FP16 1979*, FP8 3958* TF",
                  {"fp64": 34 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
                   "fp8": 1978.9 * T})
_H200_NVL = _Chip("H200 NVL", "NVIDIA H200 datasheet (NVL): FP32 60 TF, TF32 835*, BF16/FP16 1671*, FP8 3341* TF",
                  {"fp64": 30 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
                   "fp8": 1670.5 * T})
_B200 = _Chip("B200", "NVIDIA HGX B200 datasheet (per GPU): FP32 75 TF, TF32 2.2 PF*, BF16/FP16 4.5 PF*, FP8 9 PF*",
              {"fp64": 37 * T, "fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp16": 2250 * T,
               "fp8": 4500 * T})
_A100 = _Chip("A100", "NVIDIA A100 datasheet (SXM4 and PCIe, 40/80GB): FP32 19.5 TF, TF32 156, BF16/FP16 312 TF",
              {"fp64": 9.7 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T})
_L40S = _Chip("L40S", "NVIDIA L40S datasheet: FP32 91.6 TF, TF32 183, BF16/FP16 362.05, FP8 733 TF (dense)",
              {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T})
_L40 = _Chip("L40", "NVIDIA L40 datasheet: FP32 90.5 TF, TF32 181*, BF16/FP16 362.1*, FP8 724* TF",
             {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181 * T, "fp16": 181 * T, "fp8": 362 * T})
_L4 = _Chip("L4", "NVIDIA L4 datasheet: FP32 30.3 TF, TF32 120*, BF16/FP16 242*, FP8 485* TF",
            {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T})
_A10 = _Chip("A10/A10G", "NVIDIA A10 datasheet (no A10G datasheet is published): FP32 31.2 TF, TF32 62.5, BF16/FP16 125",
             {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T})
_V100_SXM = _Chip("V100 SXM2", "NVIDIA V100 datasheet (SXM2): FP32 15.7 TF, FP16 tensor 125 TF; no BF16/TF32",
                  {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T})
_V100_PCIE = _Chip("V100 PCIe", "NVIDIA V100 datasheet (PCIe): FP32 14 TF, FP16 tensor 112 TF; no BF16/TF32",
                   {"fp64": 7 * T, "fp32": 14 * T, "fp16": 112 * T})
_T4 = _Chip("T4", "NVIDIA T4 datasheet: FP32 8.1 TF, FP16 mixed-precision 65 TF; no BF16/TF32",
            {"fp32": 8.1 * T, "fp16": 65 * T})
_RTX_4090 = _Chip("RTX 4090", "NVIDIA Ada whitepaper, RTX 4090: FP32 82.6 TF, TF32 82.6, FP16/BF16 (FP32 acc.) 165.2, "
                  "FP8 (FP32 acc.) 330.3 TF", {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T,
                                             "fp16": 165.2 * T, "fp8": 330.3 * T})

# First match wins: more specific names come before names they contain ("l40s" before "l40" before "l4").
_NAME_RULES: list[tuple[re.Pattern[str], _Chip]] = [
    (re.compile(p, re.IGNORECASE), chip)
    for p, chip in [
        (r"\bH200\b.*\bNVL\b", _H200_NVL),
        (r"\bH200\b", _H200_SXM),
        (r"\bH100\b.*\bNVL\b", _H100_NVL),
        (r"\bH100\b.*\bPCIe\b", _H100_PCIE),
        (r"\bH100\b", _H100_SXM),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
        (r"\bB200\b", _B200),
        (r"\bA100\b", _A100),
        (r"\bL40S\b", _L40S),
        (r"\bL40\b", _L40),
        (r"\bL4\b", _L4),
        (r"\bA10G?\b", _A10),
        (r"\bV100\b.*\bPCIE\b", _V100_PCIE),
        (r"\bV100\b", _V100_SXM),
        (r"\bT4\b", _T4),
        (r"\bRTX 4090\b", _RTX_4090),
    ]
]


def _lookup_chip(name: str) -> _Chip | None:
    for pattern, chip in _NAME_RULES:
        if pattern.search(name):
            return chip
    return None


def _as_device(device_or_name: Any) -> torch.device | None:
    if isinstance(device_or_name, torch.device):
        return device_or_name
    if isinstance(device_or_name, str):
        try:
            return torch.device(device_or_name)
        except RuntimeError:
            return None  # a device *name* such as "NVIDIA H100 PCIe"
    raise TypeError(f"expected a torch.device, a device string or a device name, got {device_or_name!r}")


def get_peak_flops(device_or_name: Any, dtype: Any = torch.float32) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype``, from the datasheet table.

    Args:
        device_or_name: a ``torch.device`` / ``"cuda:0"`` (its name is read with ``torch.cuda.get_device_name``)
            or a device name as that function reports it, e.g. ``"NVIDIA H100 80GB HBM3"``.
        dtype: ``torch.float32``, ``"tf32"``, ``torch.bfloat16``, ``torch.float16``, ``"fp8"`` (and spellings in
            :data:`DTYPE_NAMES`).

    Returns:
        FLOP/s, or ``None`` for a CPU, an unknown device, or a data type the chip does not run in hardware (use
        :func:`measure_peak_flops` then).
    """
    key = normalize_dtype(dtype)
    device = _as_device(device_or_name)
    if device is not None:
        if device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(device)
    else:
        name = device_or_name
    chip = _lookup_chip(name)
    if chip is None:
        return None
    return chip.flops.get(key)


def table_source(name: str) -> str | None:
    """The datasheet line the table uses for a device name (for reports), or ``None`` if unknown."""
    chip = _lookup_chip(name)
    return None if chip is None else chip.source


_MEASURED: dict[tuple[Any, ...], float] = {}


def _best_mm_time(a: torch.Tensor, b: torch.Tensor, device: torch.device, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device: Any = "cpu", dtype: Any = torch.float32, *, budget_s: float = 0.25) -> float:
    """Measure a device's achievable matmul FLOP/s with a short probe; cached per process.

    A square matmul grows (to n=1024 on CPU, 8192 on GPU) until one takes an eighth of the budget, then is
    repeated for ``budget_s`` seconds (at least three
    times); the fastest run gives the rate (it is the one least disturbed by other processes, so measure on a
    quiet machine). On CPU this measures the cores (threads) the process uses now, which is the right denominator for the
    MFU of that process. Takes well under a second on CPU.

    Args:
        device: where to measure (``"cpu"``, ``"cuda:0"``, a ``torch.device``).
        dtype: the compute dtype (``"tf32"`` enables TF32 matmuls for the probe on CUDA).
        budget_s: seconds spent repeating the matmul once its size is chosen.
    """
    key_dtype = normalize_dtype(dtype)
    if key_dtype == "fp8":
        raise ValueError("measure_peak_flops cannot probe fp8 (it needs scaled matmuls): pass peak_flops= yourself")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
    device = _as_device(device) or torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    threads = torch.get_num_threads() if device.type == "cpu" else None
    cache_key = (device.type, device.index, key_dtype, threads)
    if cache_key in _MEASURED:
        return _MEASURED[cache_key]

    torch_dtype = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                   "fp16": torch.float16}[key_dtype]
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = key_dtype == "tf32"
    try:
        # grow a square matmul (up to n=1024 on CPU, 8192 on GPU) until one takes an eighth of the budget: big
        # enough that thread wake-up and launch overheads vanish, and a dtype the device only emulates (bf16 on
        # many CPUs runs 100x slower) stops growing early instead of taking seconds
        n, max_n = (1024, 8192) if device.type == "cuda" else (256, 1024)
        with torch.no_grad():
            while True:
                a = torch.randn(n, n, device=device).to(torch_dtype)
                b = torch.randn(n, n, device=device).to(torch_dtype)
                torch.mm(a, b)  # warm-up: kernel selection, first touch
                _sync(device)
                if _best_mm_time(a, b, device, 2) >= budget_s / 8 or n >= max_n:
                    break
                n *= 2
            elapsed = _best_mm_time(a, b, device, 3)
            deadline = time.perf_counter() + budget_s
            while elapsed < budget_s and time.perf_counter() < deadline:
                elapsed = min(elapsed, _best_mm_time(a, b, device, 1))
            best = 2 * n**3 / max(elapsed, 1e-9)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    _MEASURED[cache_key] = best
    return best


@dataclass(frozen=True)
class PeakFlops:
    """A peak FLOP/s figure and where it came from (``"user"``, ``"table"`` or ``"measured"``)."""

    flops: float
    source: str
    detail: str


def resolve_peak_flops(device: Any, dtype: Any, override: float | None = None, *, measure: bool = True
                       ) -> PeakFlops | None:
    """The peak to divide by: the user's ``override``, else the datasheet table, else a measured probe.

    Returns ``None`` only when nothing is known and ``measure`` is ``False`` or the probe cannot run.
    """
    key = normalize_dtype(dtype)
    if override is not None:
        if not isinstance(override, (int, float)) or override <= 0:
            raise ValueError(f"peak_flops must be a positive number of FLOP/s, got {override!r}")
        return PeakFlops(float(override), "user", "given by the user")
    device = _as_device(device) or torch.device("cpu")
    table = get_peak_flops(device, key)
    if table is not None:
        name = torch.cuda.get_device_name(device)
        return PeakFlops(table, "table", f"{name}, {key} dense: {table_source(name)}")
    if not measure:
        return None
    try:
        measured = measure_peak_flops(device, key)
    except (ValueError, RuntimeError):
        return None
    where = "CPU" if device.type == "cpu" else str(device)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return PeakFlops(measured, "measured", f"{where} {key} matmul probe{threads}")
