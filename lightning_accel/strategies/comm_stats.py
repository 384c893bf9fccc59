"""What a DDP compression strategy's hook hands to the collectives, counted per rank and logged per window.

Sizes come from tensor shapes, so counting never synchronises the device. See docs/techniques/ddp-compression.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_accel import _compat

__all__ = ["CommCounter", "CommHook", "CommStats"]

#: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, torch's DDP communication-hook signature.
CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


@dataclass
class CommStats:
    """Gradient-communication statistics of one rank, counted by the strategy's hook (cumulative since ``fit``).

    All byte counts are of the payload this rank hands to the collective (the tensors' ``numel × element_size``),
    not of wire traffic: a ring all-reduce moves about ``2·(N-1)/N`` times the payload per rank, an all-gather
    (Top-K, QSGD) receives ``N-1`` times it.

    Attributes:
        steps: synchronising backward passes (one per optimizer step; accumulation micro-batches under
            ``no_sync`` do not communicate and do not count).
        calls: hook calls (one per gradient bucket per synchronising backward).
        bytes_before: bytes of the gradient buckets before compression (their dtype, usually fp32).
        bytes_sent: bytes handed to the collectives after compression.
        powersgd_steps: steps in which PowerSGD compressed (0 for the others; warm-up steps all-reduce plainly).
        compressed_steps: steps in which the compressor ran (any compression; fp16/bf16: every step).
    """

    steps: int = 0
    calls: int = 0
    bytes_before: int = 0
    bytes_sent: int = 0
    powersgd_steps: int = 0
    compressed_steps: int = 0

    @property
    def compression_rate(self) -> float:
        """``bytes_before / bytes_sent`` (1.0 = no compression; nan before the first all-reduce)."""
        return self.bytes_before / self.bytes_sent if self.bytes_sent else float("nan")

    def as_dict(self) -> dict[str, float]:
        """The counters and ``compression_rate`` as one flat dict (what ``BottleneckDoctor`` reads)."""
        return {**asdict(self), "compression_rate": self.compression_rate}


class CommCounter:
    """This rank's :class:`CommStats`, the hook wrapper that counts into them, and the ``comm/*`` window log.

    Attributes:
        stats: the cumulative counters (replaced whole when a checkpoint restores them).
        logged: the counters at the last log (each log is the mean over the steps since).
        blocking_powersgd: finish each PowerSGD bucket before returning it to DDP (set on gloo; see
            :meth:`counting_hook`).
    """

    def __init__(self) -> None:
        self.stats = CommStats()
        self.logged = CommStats()
        self.blocking_powersgd = False
        self._lock = threading.Lock()  # completion callbacks can run on the backend's threads

    def restore(self, stats: dict[str, int]) -> None:
        """Continue from a checkpoint's counters (the next log's window starts there)."""
        self.stats = CommStats(**stats)
        self.logged = CommStats(**stats)

    def counting_hook(
        self, hook: CommHook, compression: str, mover: Any = None, param_index: dict[int, int] | None = None
    ) -> CommHook:
        """Wrap ``hook`` so it counts calls and bytes into :attr:`stats` (sizes from shapes: no sync).

        ``mover`` (a :class:`~._bucket_state.BucketStateMover`) moves the compressor's per-bucket state into each
        bucket's layout before the hook runs; ``param_index`` maps ``id(parameter)`` to its position.
        """
        index = param_index or {}

        # no annotations: DDP compares them (as objects) with dist.GradBucket/Future, and this module's are strings
        def counted(state, bucket):  # type: ignore[no-untyped-def]
            buffer = bucket.buffer()
            before = buffer.numel() * buffer.element_size()
            active = True
            if compression in ("fp16", "bf16"):
                fut = hook(state, bucket)
                sent = buffer.numel() * 2  # fp16 / bf16: 2 bytes per element
            else:
                if mover is not None:  # the state follows its parameters into this bucket layout
                    mover.enter(state, bucket.index(), [index[id(p)] for p in bucket.parameters()], buffer.device)
                # read per call: setup may move the start (Top-K's warm-up for Adam-family optimizers)
                start = state.start_powerSGD_iter if compression == "powersgd" else state.start_iter
                active = state.iter >= start
                if compression == "powersgd":
                    numel_after = state.total_numel_after_compression
                    fut = hook(state, bucket)
                    if active and self.blocking_powersgd:
                        # torch's powerSGD_hook calls .wait() inside its future callbacks; on gloo those run on
                        # gloo's two worker threads, so two buckets in flight can block both and deadlock. Finish
                        # each bucket before the next (no overlap with backward for PowerSGD on gloo).
                        fut.wait()
                    sent = (
                        (state.total_numel_after_compression - numel_after) * buffer.element_size()
                        if active
                        else before
                    )
                else:
                    sent_before = state.bytes_sent
                    fut = hook(state, bucket)
                    sent = state.bytes_sent - sent_before
            with self._lock:
                stats = self.stats
                stats.calls += 1
                stats.bytes_before += before
                stats.bytes_sent += sent
                if bucket.is_last():  # DDP reduces bucket 0 last: one per synchronising backward
                    stats.steps += 1
                    stats.compressed_steps += int(active)
                    stats.powersgd_steps += int(active and compression == "powersgd")
            return fut

        return counted

    def maybe_log(self, module: Any) -> None:
        """Log the ``comm/*`` means through ``module`` when this optimizer step ends a ``log_every_n_steps`` window."""
        trainer = _compat.module_trainer(module)
        if trainer is None or not trainer.training:
            return
        every = max(1, trainer.log_every_n_steps)
        # global_step is incremented after this call, so step N+1 is the one being finished
        if (trainer.global_step + 1) % every:
            return
        stats, last = self.stats, self.logged
        steps = stats.steps - last.steps
        if steps <= 0:
            return
        before = (stats.bytes_before - last.bytes_before) / steps
        sent = (stats.bytes_sent - last.bytes_sent) / steps
        module.log("comm/bytes_before_per_step", before, on_step=True, on_epoch=False)
        module.log("comm/bytes_sent_per_step", sent, on_step=True, on_epoch=False)
        module.log("comm/compression_rate", before / sent if sent else float("nan"), on_step=True, on_epoch=False)
        self.logged = CommStats(**asdict(stats))
