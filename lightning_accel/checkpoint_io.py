"""Checkpoints written in a background thread, with removals and loads kept in order behind the writes.

``Trainer(plugins=[la.OrderedAsyncCheckpointIO()])`` is Lightning's ``AsyncCheckpointIO`` (the checkpoint's
tensors are cloned on the training thread, then one background thread writes them while training goes on) with the
two calls Lightning's plugin leaves synchronous put in order behind the writes:

* ``remove_checkpoint``: ``ModelCheckpoint(save_top_k=k)`` removes an older checkpoint right after it submits a
  newer one. Lightning's plugin removes on the calling thread at once, so when saves come faster than the disk
  writes them, the removal of a checkpoint whose write is still queued finds no file, the write then creates it,
  and a checkpoint the callback dropped is left on disk. Here the removal is queued behind the writes.
* ``load_checkpoint``: waits for the writes queued before it, so a checkpoint saved a moment ago is read whole.

:meth:`OrderedAsyncCheckpointIO.wait` blocks until every queued write is done (and raises the first error, as the
next save or the end of the fit would). The end of the fit (``teardown``) waits for every write, as Lightning's
plugin does. Only strategies whose checkpoints go through ``strategy.checkpoint_io`` use it (single device, DDP
and this collection's ``ddp_*`` strings; DeepSpeed and the sharded strategies write their own).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import AsyncCheckpointIO
from typing_extensions import override

__all__ = ["OrderedAsyncCheckpointIO"]


class OrderedAsyncCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` with ``remove_checkpoint`` queued behind the writes and
    ``load_checkpoint`` waiting for them (see the module docstring).

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
