"""Framework-free measuring and tuning core: no Lightning imports here."""

from lightning_accel.core.batch import iter_tensors, samples_in_batch, tokens_in_batch
from lightning_accel.core.breakdown import Breakdown, split_seconds
from lightning_accel.core.comm import CommRecorder, timed_comm_hook
from lightning_accel.core.flops import FlopCounter, count_flops, transformer_flops_per_token
from lightning_accel.core.peak import PeakFlops, get_peak_flops, measure_peak_flops, resolve_peak_flops
from lightning_accel.core.report import DoctorReport, compare, plot_timeline
from lightning_accel.core.rules import STAGES, Finding, RunContext, Thresholds, diagnose
from lightning_accel.core.throughput import Rates, WindowedThroughput
from lightning_accel.core.timing import StageTimer

__all__ = [
    "STAGES",
    "Breakdown",
    "CommRecorder",
    "DoctorReport",
    "Finding",
    "FlopCounter",
    "PeakFlops",
    "Rates",
    "RunContext",
    "StageTimer",
    "Thresholds",
    "WindowedThroughput",
    "compare",
    "count_flops",
    "diagnose",
    "get_peak_flops",
    "iter_tensors",
    "measure_peak_flops",
    "plot_timeline",
    "resolve_peak_flops",
    "samples_in_batch",
    "split_seconds",
    "timed_comm_hook",
    "tokens_in_batch",
    "transformer_flops_per_token",
]
