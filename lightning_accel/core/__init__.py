"""Framework-free measuring and tuning core: no Lightning imports here."""

from lightning_accel.core.batch import iter_tensors, map_tensors, samples_in_batch, tokens_in_batch
from lightning_accel.core.flops import FlopCounter, count_flops, transformer_flops_per_token
from lightning_accel.core.peak import PeakFlops, get_peak_flops, measure_peak_flops, resolve_peak_flops
from lightning_accel.core.prefetch import PrefetchingLoader
from lightning_accel.core.throughput import Rates, WindowedThroughput
from lightning_accel.core.timing import StageTimer

__all__ = [
    "FlopCounter",
    "PeakFlops",
    "PrefetchingLoader",
    "Rates",
    "StageTimer",
    "WindowedThroughput",
    "count_flops",
    "get_peak_flops",
    "iter_tensors",
    "map_tensors",
    "measure_peak_flops",
    "resolve_peak_flops",
    "samples_in_batch",
    "tokens_in_batch",
    "transformer_flops_per_token",
]
