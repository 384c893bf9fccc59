"""Precision plugins: :class:`AutoMixedPrecision` (``Trainer(plugins=[AutoMixedPrecision()])``)."""

from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

__all__ = ["AutoMixedPrecision"]
