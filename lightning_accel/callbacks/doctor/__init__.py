"""The doctor's Lightning side: :class:`BottleneckDoctor` (the hooks and output) hands the moments of the step to
its measuring object (``measure``, ``pauses``) over the pure diagnosis in :mod:`lightning_accel.core`; beside them
the timers, run facts, utilisation, smells, live warnings and log, the attribution window and the report's files.
See ``docs/measuring/doctor.md``."""

from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

__all__ = ["BottleneckDoctor"]
