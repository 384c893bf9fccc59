"""Precision: :class:`AutoMixedPrecision` (``Trainer(plugins=[AutoMixedPrecision()])``) and :class:`Float8Training`
(``Trainer(callbacks=[Float8Training()])``, FP8 through torchao)."""

from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision
from lightning_accel.precision.float8 import Float8Training

__all__ = ["AutoMixedPrecision", "Float8Training"]
