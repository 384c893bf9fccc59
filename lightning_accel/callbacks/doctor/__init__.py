"""The doctor's Lightning side: :class:`BottleneckDoctor` (the callback: arguments, hooks, output) over the pure
diagnosis in :mod:`lightning_accel.core`. One concern per module: ``timers`` (the stage timer's hooks and
wrappers), ``facts`` (the run facts the rules read), ``utilisation`` (GPU utilisation and memory sampling),
``smells`` (the static code smells before the first step), ``live_warnings`` (findings as warnings while the fit
runs), ``attribution`` (the profiled window that attributes compute to modules) and ``report`` (the report's
files)."""

from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

__all__ = ["BottleneckDoctor"]
