"""The compressor of a DDP compression run: its hook and state object, and that state's checkpoint format.

The state is training state: a checkpoint keeps it, of every rank, per parameter. See
docs/techniques/ddp-compression.md ("Compressor state is training state").
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_accel.strategies._bucket_state import BucketStateMover
from lightning_accel.strategies.comm_stats import CommHook, CommStats
from lightning_accel.strategies.ddp_compression_config import DDPCompressionConfig

__all__ = ["Compressor"]

_CHECKPOINT_KEY = "lightning_accel_ddp_compression"


class Compressor:
    """The hook of ``config.compression``, its state object and what a checkpoint keeps of it.

    Args:
        config: the strategy's validated knobs.

    Attributes:
        state: torch's ``PowerSGDState``, or ``TopKState`` / ``QSGDState``; None for fp16/bf16 and before
            :meth:`build`.
        mover: moves the per-bucket tensors through DDP's bucket layouts (None without any; see :meth:`make_mover`).
        param_index: ``id(parameter)`` -> its position in ``model.parameters()``.
        restored: a checkpoint's entry for this rank, applied to the next state object built.
    """

    def __init__(self, config: DDPCompressionConfig) -> None:
        self.config = config
        self.state: Any = None
        self.mover: BucketStateMover | None = None
        self.param_index: dict[int, int] = {}
        self.restored: dict[str, Any] | None = None

    def build(self) -> tuple[Any, CommHook]:
        """A new (state, hook) of torch's or :mod:`.compression_hooks`, with the restored counters applied."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        from lightning_accel.strategies import compression_hooks

        compression = self.config.compression
        if compression == "fp16":
            return None, default_hooks.fp16_compress_hook
        if compression == "bf16":
            return None, default_hooks.bf16_compress_hook
        hook: CommHook
        if compression == "powersgd":
            state: Any = powerSGD_hook.PowerSGDState(process_group=None, **self.config.powersgd_kwargs)
            hook = powerSGD_hook.powerSGD_hook
        elif compression == "topk":
            state, hook = compression_hooks.TopKState(**self.config.hook_kwargs), compression_hooks.topk_hook
        else:
            state, hook = compression_hooks.QSGDState(**self.config.hook_kwargs), compression_hooks.qsgd_hook
        self.apply_restored(state)
        self.state = state
        return state, hook

    def apply_restored(self, state: Any) -> None:
        """Put the restored counters and generators into a new state object (pieces go to the mover in setup)."""
        restored = self.restored
        if not restored:
            return
        state.iter = int(restored["iter"])
        if self.config.compression == "powersgd":
            import numpy as np

            name, keys, pos, has_gauss, cached = restored["rng"]
            state.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
            state.total_numel_before_compression = int(restored["numel_before"])
            state.total_numel_after_compression = int(restored["numel_after"])
        else:
            state.bytes_sent = int(restored.get("hook_bytes_sent", 0))
            if hasattr(state, "generator_state"):  # QSGD: applied when the generator is made on the device
                state.generator_state = restored.get("generator")

    def bucket_dicts(self) -> tuple[str, ...]:
        """The state object's per-bucket dicts in use (error feedback, PowerSGD's warm-start memories)."""
        config = self.config
        if config.compression == "powersgd":
            return (("error_dict",) if config.use_error_feedback else ()) + (
                ("p_memory_dict", "q_memory_dict") if config.warm_start else ()
            )
        if config.compression == "topk" and config.use_error_feedback:
            # the velocity of momentum correction too (empty unless setup turns the correction on)
            return ("error_dict", "momentum_dict")
        if config.compression == "qsgd" and config.use_error_feedback:
            return ("error_dict",)
        return ()

    def make_mover(self, parameters: list[torch.Tensor]) -> None:
        """Index ``parameters`` and make the mover of their per-bucket state, holding the restored pieces."""
        names = self.bucket_dicts()
        self.param_index = {id(p): i for i, p in enumerate(parameters)}
        if not names:
            self.mover = None
            return
        config = self.config
        powersgd = (
            (int(config.matrix_approximation_rank), float(config.min_compression_rate))
            if config.compression == "powersgd"
            else None
        )
        self.mover = BucketStateMover([p.shape for p in parameters], names, powersgd=powersgd)
        self._give_pieces((self.restored or {}).get("pieces") or {})

    def _give_pieces(self, pieces: dict[str, Any]) -> None:
        assert self.mover is not None
        for name in self.mover.dict_names:
            self.mover.pieces[name] = {int(param): t for param, t in pieces.get(name, {}).items()}

    def local_state(self) -> dict[str, Any] | None:
        """This rank's compressor state: counters, generators, per-bucket tensors (on CPU) with their layouts."""
        state = self.state
        if state is None:
            return None
        out: dict[str, Any] = {"iter": int(state.iter)}
        if self.config.compression == "powersgd":
            name, keys, pos, has_gauss, cached = state.rng.get_state()
            out.update(
                rng=(name, keys.tolist(), int(pos), int(has_gauss), float(cached)),
                numel_before=int(state.total_numel_before_compression),
                numel_after=int(state.total_numel_after_compression),
            )
        else:
            out["hook_bytes_sent"] = int(state.bytes_sent)
            if self.config.compression == "topk":  # for reading only: the step counter sets the density on resume
                out["density"] = float(state.current_density)
            generator = getattr(state, "generator", None)
            out["generator"] = (
                generator.get_state() if generator is not None else getattr(state, "generator_state", None)
            )
        # per parameter (position in model.parameters()), so a run with another bucket layout can take it
        out["pieces"] = self.mover.state_pieces(state) if self.mover is not None else {}
        return out

    def state_dict(self, comm_stats: CommStats) -> dict[str, Any]:
        """The checkpoint entry: plain objects and CPU tensors (weights_only-safe), every rank's state gathered.

        A collective under a running process group with several ranks: call it on every rank.
        """
        compression = self.config.compression
        out: dict[str, Any] = {"compression": compression, "comm_stats": asdict(comm_stats)}
        local = self.local_state()
        if local is None:
            return out
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, local)
        else:
            ranks = [local]
        out.update(world_size=len(ranks), ranks=ranks)
        if compression == "powersgd":  # the counters of earlier releases, kept readable
            out.update(
                powersgd_iter=local["iter"],
                powersgd_rng=local["rng"],
                powersgd_numel_before=local["numel_before"],
                powersgd_numel_after=local["numel_after"],
            )
        return out

    def load_state_dict(self, saved: dict[str, Any], *, world_size: int, rank: int) -> bool:
        """Take this rank's entry of :meth:`state_dict`, applied when :meth:`build` runs, or at once when the state
        object exists already. A checkpoint of another compression is not restored (a warning says so): False."""
        if saved.get("compression") != self.config.compression:
            rank_zero_warn(
                f"checkpoint was written with compression={saved.get('compression')!r}, this run uses "
                f"{self.config.compression!r}: communication statistics and compressor state are not restored"
            )
            return False
        restored: dict[str, Any] | None = None
        if "ranks" in saved:
            ranks = saved["ranks"]
            if len(ranks) == world_size:
                restored = dict(ranks[rank])
            else:
                # counters and generators are the same on every rank (PowerSGD) or per rank (QSGD's seeds): take
                # rank 0's counters; residuals belong to ranks that no longer exist
                restored = {**ranks[0], "pieces": {}}
                if "generator" in restored:
                    restored["generator"] = None
                rank_zero_warn(
                    f"{self.config.string}: checkpoint written by {len(ranks)} ranks, this run has "
                    f"{world_size}: error-feedback residuals restart from zero"
                )
        elif "powersgd_iter" in saved:  # a checkpoint of an earlier release: counters only
            restored = {
                "iter": saved["powersgd_iter"],
                "rng": saved["powersgd_rng"],
                "numel_before": saved["powersgd_numel_before"],
                "numel_after": saved["powersgd_numel_after"],
            }
        self.restored = restored
        if restored is not None and self.state is not None:  # restored after setup: apply now
            self.apply_restored(self.state)
            if self.mover is not None:
                self.mover.split_all(self.state)
                self._give_pieces(restored.get("pieces", {}))
        return True
