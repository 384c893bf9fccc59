"""Checkpoints written in a background thread, with removals and loads kept in order behind the writes.

Lightning's ``AsyncCheckpointIO`` leaves ``remove_checkpoint`` and ``load_checkpoint`` synchronous, so a checkpoint
``ModelCheckpoint(save_top_k=k)`` dropped can be left on disk; here both wait behind the queued writes. See
docs/techniques/async-checkpointing.md.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import AsyncCheckpointIO
from typing_extensions import override

__all__ = ["OrderedAsyncCheckpointIO"]


class OrderedAsyncCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` with ``remove_checkpoint`` queued behind the writes and
    ``load_checkpoint`` waiting for them (docs/techniques/async-checkpointing.md).

    Args:
        checkpoint_io: the plugin that writes (default: Lightning's ``TorchCheckpointIO``, set by the strategy).
    """

    @override
    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._ensure_setup()

        def _remove() -> None:
            try:
                assert self.checkpoint_io is not None
                self.checkpoint_io.remove_checkpoint(*args, **kwargs)
            except BaseException as ex:  # noqa: BLE001 - raised on the training thread by the next call
                self._error = ex

        assert self._executor is not None
        self._executor.submit(_remove)
        if self._error:
            raise self._error

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(*args, **kwargs)

    def wait(self) -> None:
        """Block until every write and removal queued so far is done; raise the first error one of them had."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()  # one worker: runs after everything queued before it
        if self._error:
            raise self._error
