"""The Autopilot's Lightning side: :class:`Autopilot` (the callback: arguments, hooks, output) over the search in
:mod:`lightning_accel.core.autopilot`. One concern per module: ``backend`` (the search loop's Lightning backend:
windows, probes and agreement across ranks, the fixes the diagnosis proposes), ``windows`` (the measuring windows
and the numerics probes, run outside Lightning's loop), ``checkpoint_trial`` (the trial of the fix outside the
step), ``display`` (the live view) and ``fixes/`` (each change the search may try, returning its undo)."""

from lightning_accel.callbacks.autopilot.callback import Autopilot

__all__ = ["Autopilot"]
