"""Peak FLOP/s of a device: a datasheet table for GPUs; for CPUs the cores' hardware rate, checked by a matmul probe.

Every table entry is the **dense** figure (NVIDIA datasheets print the 2:4-sparse figure with an asterisk; dense is
half of it). For fp16/bf16/fp8 it is the tensor-core rate with fp32 accumulation where the datasheet tells them
apart (GeForce cards run fp16 with fp16 accumulation at twice the rate; mixed-precision training accumulates in
fp32). A chip without a data type in hardware (bf16 on V100/T4, fp8 before Ada/Hopper) has no entry: ``None``.

CPUs have no table: :func:`cpu_hardware_peak` derives cores × clock × FLOPs per cycle from ``/proc/cpuinfo`` and
cpufreq, and :func:`resolve_peak_flops` takes the larger of that and a short matmul probe (see its docstring for why
the hardware figure comes first).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DTYPE_NAMES",
    "PeakFlops",
    "cpu_hardware_peak",
    "format_flops",
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
class PeakFlops:
    """A peak FLOP/s figure and where it came from.

    ``source`` is ``"user"`` (``peak_flops=``), ``"table"`` (a GPU datasheet), ``"hardware"`` (CPU cores x clock x
    FLOPs per cycle), ``"measured"`` (a matmul probe) or ``"achieved"`` (a measuring window ran faster than the
    peak it had: MFUMonitor raises the peak to that rate). ``detail`` says how the figure was obtained.
    """

    flops: float
    source: str
    detail: str


@dataclass(frozen=True)
class _Chip:
    label: str
    source: str
    flops: dict[str, float]


# Dense peaks in FLOP/s. Sources are the vendor datasheets; the sparse (asterisked) figure is halved.
_H100_SXM = _Chip(
    "H100 SXM5",
    "NVIDIA H100 datasheet (SXM5): FP32 67 TF, TF32 989*, BF16/FP16 1979*, FP8 3958* TF",
    {"fp64": 34 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T},
)
_H100_PCIE = _Chip(
    "H100 PCIe",
    "NVIDIA H100 datasheet (PCIe): FP32 51 TF, TF32 756*, BF16/FP16 1513*, FP8 3026* TF",
    {"fp64": 26 * T, "fp32": 51.2 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T, "fp8": 1513 * T},
)
_H100_NVL = _Chip(
    "H100 NVL",
    "NVIDIA H100 datasheet (NVL, per GPU): FP32 60 TF, TF32 835*, BF16/FP16 1671*, FP8 3341*",
    {"fp64": 30 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T},
)
_H200_SXM = _Chip(
    "H200 SXM",
    "NVIDIA H200 datasheet (SXM): FP32 67 TF, TF32 989*, BF16/FP16 1979*, FP8 3958* TF",
    {"fp64": 34 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T},
)
_H200_NVL = _Chip(
    "H200 NVL",
    "NVIDIA H200 datasheet (NVL): FP32 60 TF, TF32 835*, BF16/FP16 1671*, FP8 3341* TF",
    {"fp64": 30 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T},
)
_B200 = _Chip(
    "B200",
    "NVIDIA HGX B200 datasheet (per GPU): FP32 75 TF, TF32 2.2 PF*, BF16/FP16 4.5 PF*, FP8 9 PF*",
    {"fp64": 37 * T, "fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T},
)
_A100 = _Chip(
    "A100",
    "NVIDIA A100 datasheet (SXM4 and PCIe, 40/80GB): FP32 19.5 TF, TF32 156, BF16/FP16 312 TF",
    {"fp64": 9.7 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
)
_L40S = _Chip(
    "L40S",
    "NVIDIA L40S datasheet: FP32 91.6 TF, TF32 183, BF16/FP16 362.05, FP8 733 TF (dense)",
    {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T},
)
_L40 = _Chip(
    "L40",
    "NVIDIA L40 datasheet: FP32 90.5 TF, TF32 181*, BF16/FP16 362.1*, FP8 724* TF",
    {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181 * T, "fp16": 181 * T, "fp8": 362 * T},
)
_L4 = _Chip(
    "L4",
    "NVIDIA L4 datasheet: FP32 30.3 TF, TF32 120*, BF16/FP16 242*, FP8 485* TF",
    {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T},
)
_A10 = _Chip(
    "A10/A10G",
    "NVIDIA A10 datasheet (no A10G datasheet is published): FP32 31.2 TF, TF32 62.5, BF16/FP16 125",
    {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},
)
_V100_SXM = _Chip(
    "V100 SXM2",
    "NVIDIA V100 datasheet (SXM2): FP32 15.7 TF, FP16 tensor 125 TF; no BF16/TF32",
    {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T},
)
_V100_PCIE = _Chip(
    "V100 PCIe",
    "NVIDIA V100 datasheet (PCIe): FP32 14 TF, FP16 tensor 112 TF; no BF16/TF32",
    {"fp64": 7 * T, "fp32": 14 * T, "fp16": 112 * T},
)
_T4 = _Chip(
    "T4",
    "NVIDIA T4 datasheet: FP32 8.1 TF, FP16 mixed-precision 65 TF; no BF16/TF32",
    {"fp32": 8.1 * T, "fp16": 65 * T},
)
_RTX_4090 = _Chip(
    "RTX 4090",
    "NVIDIA Ada whitepaper, RTX 4090: FP32 82.6 TF, TF32 82.6, FP16/BF16 (FP32 acc.) 165.2, FP8 (FP32 acc.) 330.3 TF",
    {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T},
)

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


# ------------------------------------------------------------------------------------ CPUs: the hardware rate

_CPUINFO = Path("/proc/cpuinfo")
_SYSFS_CPU = Path("/sys/devices/system/cpu")

# Arm cores by (implementer, part) as /proc/cpuinfo prints them: fp32 FLOPs per cycle per core and the pipes behind
# it, from Arm's software optimization guides (FMA throughput per cycle x lanes x 2). Other parts: no figure (probe).
_ARM_CORES: dict[tuple[str, str], tuple[int, str]] = {
    ("0x41", "0xd0c"): (16, "Neoverse N1: 2 x 128-bit FMA pipes"),
    ("0x41", "0xd40"): (32, "Neoverse V1: 2 x 256-bit SVE FMA pipes"),
    ("0x41", "0xd49"): (16, "Neoverse N2: 2 x 128-bit SVE2 FMA pipes"),
    ("0x41", "0xd4f"): (32, "Neoverse V2: 4 x 128-bit FMA pipes"),
}


def format_flops(flops: float) -> str:
    """``1.526e11`` -> ``"152.6 GFLOP/s"``: the largest SI prefix (up to T) the figure reaches, one decimal."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops >= scale:
            return f"{flops / scale:,.1f} {prefix}FLOP/s"
    return f"{flops:.1f} FLOP/s"


def _cpuinfo_blocks(text: str) -> dict[int, dict[str, str]]:
    """``/proc/cpuinfo`` as {processor number: {field: value}} (blocks without a processor number are dropped)."""
    blocks: dict[int, dict[str, str]] = {}
    for chunk in re.split(r"\n\s*\n", text):
        fields = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if fields.get("processor", "").isdigit():
            blocks[int(fields["processor"])] = fields
    return blocks


def _x86_fp32_per_cycle(cpu: dict[str, str]) -> tuple[int, str] | None:
    """fp32 FLOPs per cycle per core of the widest FMA ISA the flags show, and the units behind it.

    MKL and oneDNN, torch's CPU matmul kernels, dispatch to the widest ISA the CPU reports. The flags do not say
    how many FMA units a core has, so each ISA counts the most any core with it has (two), except AMD families
    whose narrower datapath is known from the family: the figure is an upper bound. Sources: Intel's optimization
    reference manual (Haswell onward: two 256-bit FMA ports; Skylake-SP Gold 6 / Platinum and later Xeons: two
    512-bit FMA units, so 2 x 16 lanes x 2 = 64) and AMD's software optimization guides (Zen/Zen+ and Hygon
    Dhyana: 128-bit FP pipes, AVX2 split in two; Zen 2/3: two 256-bit FMA pipes; Zen 4: AVX-512 through the
    256-bit pipes; Zen 5: 512-bit pipes).
    """
    flags = set(cpu.get("flags", "").split())
    vendor = cpu.get("vendor_id", "")
    try:
        family, model = int(cpu.get("cpu family", "0")), int(cpu.get("model", "0"))
    except ValueError:
        family = model = 0
    amd_like = vendor in ("AuthenticAMD", "HygonGenuine")
    if "avx512f" in flags:
        if amd_like and family < 0x1A:
            return 32, "AVX-512 FMA through 2 x 256-bit pipes (AMD Zen 4)"
        return 64, "AVX-512 FMA: 2 x 512-bit FMA units"
    if "fma" in flags and "avx" in flags:
        if amd_like and (family == 0x18 or (family == 0x17 and model < 0x30)):
            return 16, "AVX2 FMA through 2 x 128-bit pipes (AMD Zen/Zen+)"
        return 32, "AVX2 FMA: 2 x 256-bit FMA units"
    if "avx" in flags:
        return 16, "AVX without FMA: one 256-bit multiply + one 256-bit add"
    if "sse2" in flags:
        return 8, "SSE2: one 128-bit multiply + one 128-bit add"
    return None


def _per_cycle(cpu: dict[str, str], key: str) -> tuple[float, str] | None:
    """FLOPs per cycle per core for dtype ``key`` and how they arise; ``None`` where the core is not known."""
    if "flags" in cpu:  # x86
        base = _x86_fp32_per_cycle(cpu)
        if base is None:
            return None
        fp32, isa = base
        flags = set(cpu["flags"].split())
        if key in ("fp32", "tf32"):  # a CPU has no TF32: the matmul runs in fp32
            return fp32, isa
        if key == "fp64":
            return fp32 / 2, f"{isa}, half the fp32 lanes"
        if key == "bf16":
            if "amx_bf16" in flags:  # TDPBF16PS: 16x16x32 MACs every 16 cycles = 1024 FLOPs per cycle
                return 1024, "AMX-BF16 tiles"
            if "avx512_bf16" in flags:  # VDPBF16PS: two bf16 products per fp32 lane, on the fp32 FMA units
                return 2 * fp32, f"AVX512-BF16 dot products, 2 x the fp32 rate of {isa}"
            return fp32, f"no bf16 instructions: bf16 runs on the fp32 FMA units, {isa}"
        if key == "fp16":
            if "amx_fp16" in flags:
                return 1024, "AMX-FP16 tiles"
            if "avx512_fp16" in flags:
                return 2 * fp32, f"AVX512-FP16, 2 x the fp32 rate of {isa}"
            return fp32, f"no fp16 arithmetic: fp16 runs on the fp32 FMA units, {isa}"
        return None  # fp8: no CPU runs it
    part = _ARM_CORES.get((cpu.get("CPU implementer", ""), cpu.get("CPU part", "")))
    if part is None:
        return None
    fp32, pipes = part
    if key in ("fp32", "tf32"):
        return fp32, pipes
    if key == "fp64":
        return fp32 / 2, f"{pipes}, half the fp32 lanes"
    return None  # bf16/fp16 throughput differs between Arm cores in ways the features do not show: probe


def _max_clock_hz(cpus: Iterable[int], blocks: dict[int, dict[str, str]], sysfs_cpu: Path) -> tuple[float, str] | None:
    """The highest clock the cores reach and where it was read, or ``None``.

    cpufreq's ``cpuinfo_max_freq`` (kHz) is the top of the frequency range, turbo included where the driver
    exposes it. Without cpufreq (most VMs) the larger of ``cpu MHz`` (the current clock; a VM's nominal one) and
    the clock in the model name (Intel prints the base clock there) is the best upper figure the system shows.
    """
    cpus = list(cpus)
    khz = []
    for n in cpus:
        try:
            khz.append(int((sysfs_cpu / f"cpu{n}" / "cpufreq" / "cpuinfo_max_freq").read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    if khz and max(khz) > 0:
        return max(khz) * 1e3, "cpufreq max"
    found: list[tuple[float, str]] = []
    for n in cpus:
        cpu = blocks.get(n, {})
        try:
            found.append((float(cpu["cpu MHz"]) * 1e6, "cpuinfo cpu MHz"))
        except (KeyError, ValueError):
            pass
        named = re.search(r"@\s*([0-9.]+)\s*GHz", cpu.get("model name", ""))
        if named:
            found.append((float(named.group(1)) * 1e9, "model name"))
    found = [f for f in found if f[0] > 0]
    return max(found) if found else None


def _physical_cores(cpus: list[int], blocks: dict[int, dict[str, str]]) -> int:
    """Cores under the logical CPUs ``cpus``: SMT siblings share one core's FMA units."""
    mine = [blocks[n] for n in cpus if n in blocks]
    if mine and all("core id" in cpu for cpu in mine):
        return len({(cpu.get("physical id"), cpu["core id"]) for cpu in mine})
    return len(cpus)


def cpu_hardware_peak(
    dtype: Any = torch.float32,
    *,
    threads: int | None = None,
    affinity: Iterable[int] | None = None,
    cpuinfo: Path = _CPUINFO,
    sysfs_cpu: Path = _SYSFS_CPU,
) -> PeakFlops | None:
    """The CPU's peak FLOP/s for ``dtype`` from the hardware: cores x clock x FLOPs per cycle per core.

    * cores: the physical cores under the CPUs this process may run on (affinity; SMT siblings count once), at most
      ``threads`` (torch's intra-op threads, ``torch.get_num_threads()``): the cores torch's matmuls use;
    * clock: cpufreq's maximum, else the larger of ``/proc/cpuinfo``'s ``cpu MHz`` and the model name's GHz;
    * FLOPs per cycle: from the ISA the flags show (x86) or the core part (Arm Neoverse N1/V1/N2/V2), as the
      comments of ``_x86_fp32_per_cycle`` / ``_ARM_CORES`` source them.

    Every factor is the most the hardware could do (two FMA units where the flags cannot tell one from two, the
    single-core turbo clock where cpufreq gives it): an upper bound, so an MFU against it stays a fraction. A clock
    read below the real one (a VM's nominal ``cpu MHz`` under turbo) is the one way it reads low;
    :func:`resolve_peak_flops` checks it against a probe for that reason.

    Returns ``None`` where the CPU, its clock or the dtype's rate is not known (other architectures, Arm parts not
    in the table, Arm bf16/fp16, fp8, no ``/proc/cpuinfo``).
    """
    key = normalize_dtype(dtype)
    try:
        blocks = _cpuinfo_blocks(cpuinfo.read_text())
    except OSError:
        return None
    if not blocks:
        return None
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            affinity = blocks
    cpus = sorted(n for n in affinity if n in blocks) or sorted(blocks)
    rate = _per_cycle(blocks[cpus[0]], key)
    clock = _max_clock_hz(cpus, blocks, sysfs_cpu)
    if rate is None or clock is None:
        return None
    cores = _physical_cores(cpus, blocks)
    if threads is None:
        threads = torch.get_num_threads()
    cores = max(1, min(cores, threads))
    per_cycle, why = rate
    hz, clock_source = clock
    flops = cores * hz * per_cycle
    return PeakFlops(
        flops,
        "hardware",
        f"hardware: {cores} core{'s' if cores > 1 else ''} x {hz / 1e9:.2f} GHz ({clock_source}) x "
        f"{per_cycle:g} {key} FLOP/cycle ({why}) = {format_flops(flops)}",
    )


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

    torch_dtype = {
        "fp64": torch.float64,
        "fp32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }[key_dtype]
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


def resolve_peak_flops(
    device: Any, dtype: Any, override: float | None = None, *, measure: bool = True
) -> PeakFlops | None:
    """The peak to divide by: the user's ``override``, else the datasheet table (GPUs), else for a CPU the larger
    of the hardware figure (:func:`cpu_hardware_peak`) and a matmul probe, else (an unknown GPU) the probe.

    On a CPU the hardware figure comes first because it cannot read low for the reason probes do: a probe is the
    fastest of a fraction of a second of matmuls, and on a machine other processes share that fraction can run at
    half speed, after which training "achieves" more than the peak (MFU above 1). The hardware figure is the same
    whatever the load, costs nothing, and is what utilisation means: the share of what the cores could do. Its
    one way to read low is a clock below the real one (turbo above cpufreq's figure, a VM's nominal ``cpu MHz``);
    the probe still runs (``measure=True``) to catch that: a probe above the hardware figure replaces it, and the
    detail names both. Where the hardware is not known (other architectures, unknown Arm cores) the probe is the
    peak. Either way a window that later runs faster raises the peak (``MFUMonitor``).

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
    hardware = cpu_hardware_peak(key) if device.type == "cpu" else None
    probe = None
    if measure:
        try:
            probe = measure_peak_flops(device, key)
        except (ValueError, RuntimeError):  # fp8, or a dtype the device cannot multiply in
            probe = None
    return _larger_of(hardware, probe, key, device)


def _larger_of(hardware: PeakFlops | None, probe: float | None, key: str, device: torch.device) -> PeakFlops | None:
    """The hardware figure, unless the probe ran faster (then the probe, saying which figure it beat)."""
    if probe is None:
        return hardware
    where = "CPU" if device.type == "cpu" else str(device)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    measured = f"probe: {format_flops(probe)}, fastest {key} matmul on {where}{threads}"
    if hardware is None:
        return PeakFlops(probe, "measured", measured)
    if probe > hardware.flops:
        return PeakFlops(
            probe,
            "measured",
            f"{measured}; above the hardware figure "
            f"({hardware.detail.removeprefix('hardware: ')}): the cores ran faster "
            "than the clock read (turbo, or a VM's nominal clock)",
        )
    return PeakFlops(
        hardware.flops, "hardware", f"{hardware.detail}; the probe reached {100 * probe / hardware.flops:.0f} % of it"
    )
