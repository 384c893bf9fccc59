"""Framework-free measuring and tuning core: no Lightning imports here."""

from lightning_accel.core.batch import iter_tensors, map_tensors, samples_in_batch, tokens_in_batch
from lightning_accel.core.batch_size_search import (
    BatchSizeSearch,
    BatchSizeSearchError,
    MemoryModel,
    ProbeRecord,
    find_batch_size,
    find_throughput_batch_size,
)
from lightning_accel.core.breakdown import Breakdown, split_seconds
from lightning_accel.core.checkpointing import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    saved_activation_bytes,
)
from lightning_accel.core.comm import CommRecorder, timed_comm_hook
from lightning_accel.core.flops import FlopCounter, count_flops, transformer_flops_per_token
from lightning_accel.core.memory import ZeroMemoryEstimate, estimate_zero_memory
from lightning_accel.core.memory_probe import PeakMemoryMeter, device_memory_capacity, peak_rss_bytes, reset_peak_rss
from lightning_accel.core.peak import PeakFlops, get_peak_flops, measure_peak_flops, resolve_peak_flops
from lightning_accel.core.phases import FitBreakdown, FitClock, diagnose_fit
from lightning_accel.core.precision import Fp32Islands, choose_autocast_dtype, supported_autocast_dtypes
from lightning_accel.core.prefetch import PrefetchingLoader
from lightning_accel.core.ranks import find_stragglers
from lightning_accel.core.report import DoctorReport, compare, plot_timeline
from lightning_accel.core.rules import STAGES, Finding, RunContext, Thresholds, diagnose
from lightning_accel.core.smells import SMELLS, find_smells
from lightning_accel.core.stages import StageMachine, StageWindow
from lightning_accel.core.throughput import Rates, WindowedThroughput
from lightning_accel.core.timing import StageTimer
from lightning_accel.core.variability import variability_finding
from lightning_accel.core.verdict import build_report

__all__ = [
    "BatchSizeSearch",
    "BatchSizeSearchError",
    "Breakdown",
    "CommRecorder",
    "DoctorReport",
    "Finding",
    "FitBreakdown",
    "FitClock",
    "FlopCounter",
    "Fp32Islands",
    "MemoryModel",
    "PeakFlops",
    "PeakMemoryMeter",
    "PrefetchingLoader",
    "ProbeRecord",
    "Rates",
    "RunContext",
    "SMELLS",
    "STAGES",
    "StageMachine",
    "StageTimer",
    "StageWindow",
    "Thresholds",
    "WindowedThroughput",
    "ZeroMemoryEstimate",
    "apply_activation_checkpointing",
    "build_report",
    "choose_autocast_dtype",
    "compare",
    "count_flops",
    "device_memory_capacity",
    "diagnose",
    "diagnose_fit",
    "estimate_zero_memory",
    "find_batch_size",
    "find_smells",
    "find_stragglers",
    "find_throughput_batch_size",
    "get_peak_flops",
    "iter_tensors",
    "map_tensors",
    "measure_peak_flops",
    "peak_rss_bytes",
    "plot_timeline",
    "remove_activation_checkpointing",
    "reset_peak_rss",
    "resolve_peak_flops",
    "samples_in_batch",
    "saved_activation_bytes",
    "split_seconds",
    "supported_autocast_dtypes",
    "timed_comm_hook",
    "tokens_in_batch",
    "transformer_flops_per_token",
    "variability_finding",
]
