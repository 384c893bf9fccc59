"""The gradient reduction of a pipeline-parallel run, before each optimizer step: the tied weights' two copies summed
between the first and the last stage, and each stage's gradients averaged over its data-parallel replicas, plain or
through a ``ddp_<compression>`` communication hook. See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["GradientReducer"]


class GradientReducer:
    """The gradient exchange of this rank's stages, and the compressor's state (counters, residuals, generator).

    Args:
        compression: ``"fp16"``, ``"bf16"``, ``"topk"``, ``"qsgd"`` or None (plain all-reduce).
        density: Top-K's fraction of entries sent.
        levels: QSGD's quantisation levels.
    """

    def __init__(self, compression: str | None, *, density: float = 0.01, levels: int = 7) -> None:
        self.compression = compression
        #: the compressor's arguments
        self.knobs: dict[str, Any] = (
            {"density": float(density)}
            if compression == "topk"
            else ({"levels": levels} if compression == "qsgd" else {})
        )
        #: the data-parallel gradient exchange's counters (:class:`~.ddp_compression.CommStats`; pp_ddp only)
        self.comm_stats: Any = None
        self.tied: list[tuple[str, str]] = []
        self._saved: dict[str, Any] | None = None  # from a checkpoint, until the hook is made
        self._dp_group: Any = None
        self._tie_group: Any = None
        self._dp_size = 1
        self._net_attr = ""
        self._has_first = self._has_last = False
        self._world_size, self._rank = 1, 0
        self._dp_hook: tuple[Any, Callable[..., Any]] | None = None
        #: the replica average's compressor: its state, and that state in ``ddp_<compression>``'s checkpoint format
        self._compressor: Any = None

    def configure(
        self,
        *,
        dp_group: Any,
        dp_size: int,
        tie_group: Any,
        world_size: int,
        rank: int,
    ) -> None:
        """The groups of a new split: a compression hook's state is bound to the replica group, so it starts over."""
        self._dp_group, self._dp_size, self._tie_group = dp_group, dp_size, tie_group
        self._world_size, self._rank = world_size, rank
        self._dp_hook = None
        self._compressor = None

    def place(self, *, net_attr: str, tied: list[tuple[str, str]], has_first: bool, has_last: bool) -> None:
        """Which tied weights this rank's stages hold: ``tied`` pairs of names in the network ``net_attr``."""
        self._net_attr, self.tied, self._has_first, self._has_last = net_attr, tied, has_first, has_last

    def restore(self, saved: dict[str, Any]) -> None:
        """A checkpoint's compressor state, applied when the first exchange makes the compressor."""
        self._saved = saved

    def reduce(self, module: nn.Module) -> None:
        """Sum the tied embedding's gradients of the first and last stage; average over data-parallel replicas."""
        import torch.distributed as dist

        self._reduce_tied(module, average=False)
        if self._dp_group is not None and self.compression is not None:
            self._reduce_compressed(module, [p for p in module.parameters() if p.grad is not None])
            if self.compression in ("topk", "qsgd"):
                # Top-K selects and QSGD rounds over each stage's own flat bucket, so the first and the last stage
                # would apply different updates to their copies of a tied weight, which would drift apart: both take
                # the mean of the two compressed averages (each an estimate of the same gradient)
                self._reduce_tied(module, average=True)
        elif self._dp_group is not None:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self._dp_group)
                    p.grad.div_(self._dp_size)

    def _reduce_tied(self, module: nn.Module, *, average: bool) -> None:
        """All-reduce the tied weights' gradients between the first and the last stage (sum, or mean)."""
        import torch.distributed as dist

        if not (self.tied and self._tie_group is not None and (self._has_first or self._has_last)):
            return
        params = dict(module.named_parameters(remove_duplicate=False))
        prefix = self._net_attr + "."
        for first, last in self.tied:
            p = params.get(prefix + (first if self._has_first else last))
            if p is not None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad, group=self._tie_group)
                p.grad = grad.div_(2) if average else grad

    def _make_dp_hook(self, module: nn.Module) -> tuple[Any, Callable[..., Any]]:
        """(state, hook): the hook ``ddp_<compression>`` registers with DDP, over the replica group."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from lightning_accel.strategies import compression_hooks

        if self.compression in ("fp16", "bf16"):
            self._attach_compressor_state(module, None)  # no compressor state: the counters only
            cast = default_hooks.fp16_compress_hook if self.compression == "fp16" else default_hooks.bf16_compress_hook
            return self._dp_group, cast
        state: Any
        if self.compression == "topk":
            from lightning_accel.strategies.ddp_compression import DEFAULT_DENSITY_WARMUP_STEPS

            # ddp_topk's density warm-up; its momentum correction and Adam warm-up are not applied here
            knobs: dict[str, Any] = {"density_warmup_steps": DEFAULT_DENSITY_WARMUP_STEPS, **self.knobs}
            state, hook = (
                compression_hooks.TopKState(process_group=self._dp_group, **knobs),
                compression_hooks.topk_hook,
            )
        else:
            state = compression_hooks.QSGDState(process_group=self._dp_group, **self.knobs)
            hook = compression_hooks.qsgd_hook
        self._attach_compressor_state(module, state)
        return state, hook

    def compressor(self) -> Any:
        """The replica average's :class:`~.compressor_state.Compressor`, the one ``ddp_<compression>`` uses: it
        holds the compressor state and saves and restores it in that strategy's checkpoint format."""
        if self._compressor is None:
            from lightning_accel.strategies.compressor_state import Compressor
            from lightning_accel.strategies.ddp_compression_config import DDPCompressionConfig

            self._compressor = Compressor(DDPCompressionConfig(compression=self.compression, **self.knobs))  # type: ignore[arg-type]
        return self._compressor

    def _attach_compressor_state(self, module: nn.Module, state: Any | None) -> None:
        """Give the new compressor state to the compressor, with a mover that splits the stage's one flat bucket into
        per-parameter pieces (the checkpoint's format), then restore a checkpoint's state into it."""
        from lightning_accel.strategies.comm_stats import CommStats

        compressor = self.compressor()
        compressor.state = state
        compressor.make_mover(list(module.parameters()))
        stats = CommStats()
        saved, self._saved = self._saved, None
        if saved is not None and compressor.load_state_dict(saved, world_size=self._world_size, rank=self._rank):
            by_rank = saved.get("comm_stats_of_ranks")
            # this rank's own counters (they differ by stage), else the checkpoint's
            stats = CommStats(
                **(by_rank[self._rank] if by_rank and len(by_rank) == self._world_size else saved["comm_stats"])
            )
        self.comm_stats = stats

    def _reduce_compressed(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """Average the stage's gradients over the replicas through a DDP compression hook: all of them as one
        flat bucket (index 0 every step, so Top-K's error residual stays attached to the same entries)."""
        if self._dp_hook is None:
            self._dp_hook = self._make_dp_hook(module)
        state, hook = self._dp_hook
        flat = torch.cat([p.grad.detach().reshape(-1).to(torch.float32) for p in params])  # type: ignore[union-attr]
        bucket = _FlatBucket(flat, params)
        compressor = self._compressor
        if compressor is not None and compressor.mover is not None:  # the residual follows its parameters (a resume)
            layout = [compressor.param_index[id(p)] for p in params]
            compressor.mover.enter(state, 0, layout, flat.device)
        started = getattr(state, "iter", 0) >= getattr(state, "start_iter", 0)
        sent_before = getattr(state, "bytes_sent", 0)
        reduced = hook(state, bucket).wait()
        reduced = reduced[0] if isinstance(reduced, list) else reduced
        stats = self.comm_stats
        stats.calls += 1
        stats.steps += 1
        stats.compressed_steps += int(started)
        stats.bytes_before += flat.numel() * flat.element_size()
        stats.bytes_sent += flat.numel() * 2 if self.compression in ("fp16", "bf16") else state.bytes_sent - sent_before
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(reduced[offset : offset + n].view_as(p.grad))  # type: ignore[union-attr]
            offset += n

    def state_dict(self) -> dict[str, Any] | None:
        """The compressor's state as ``ddp_<compression>`` saves it (None without compression); a collective."""
        if self.compression is None:
            return None
        if self._dp_hook is None and self._saved is not None:  # restored, not yet applied: kept as is
            return self._saved
        from dataclasses import asdict

        import torch.distributed as dist

        from lightning_accel.strategies.comm_stats import CommStats

        stats = self.comm_stats if self.comm_stats is not None else CommStats()
        state = self.compressor().state_dict(stats)
        # the counters differ by stage (ddp_<compression>'s are rank 0's, the same on every rank there): every rank's
        mine = asdict(stats)
        ranks: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return {**state, "comm_stats_of_ranks": ranks}


class _FlatBucket:
    """What a DDP communication hook reads of a ``dist.GradBucket``: one flat fp32 buffer, always bucket 0."""

    def __init__(self, buffer: torch.Tensor, params: list[nn.Parameter]) -> None:
        self._buffer, self._params = buffer, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[nn.Parameter]:
        return self._params
