"""The ``callbacks_factory`` entry points Lightning calls on every ``Trainer(...)``: nothing unless ``LIGHTNING_ACCEL``
is set (docs/attach.md). A top-level module so that, unset, it imports nothing of ``lightning_accel`` (whose import
registers the strategy strings with ``lightning``, also in a ``pytorch_lightning`` script)."""

import os


def lightning_callbacks() -> list:
    """For ``lightning.pytorch.Trainer``."""
    if not os.environ.get("LIGHTNING_ACCEL", "").strip():
        return []
    from lightning_accel.attach import callbacks_factory

    return callbacks_factory()


def pytorch_lightning_callbacks() -> list:
    """For ``pytorch_lightning.Trainer`` (the standalone package): the same callbacks."""
    return lightning_callbacks()
