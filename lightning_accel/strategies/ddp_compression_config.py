"""The knobs of the DDP compression strategies as one dataclass, validated when it is built.

Each error names the value and the fix. See docs/techniques/ddp-compression.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_accel.strategies.compression_hooks import qsgd_variance_bound

__all__ = ["DEFAULT_ADAPTIVE_WARMUP_STEPS", "DEFAULT_DENSITY_WARMUP_STEPS", "Compression", "DDPCompressionConfig"]

Compression = Literal["fp16", "bf16", "powersgd", "topk", "qsgd"]
_COMPRESSIONS = ("fp16", "bf16", "powersgd", "topk", "qsgd")

#: ``ddp_topk``'s compressed steps per stage of DGC's density warm-up (25 % → 6.25 % → 1.5625 % → 1 %: 3 stages,
#: 192 steps at the default density). DGC ramps over its first 4 of 90 epochs; a step count does not depend on the
#: data set's size, and 3 × 64 steps give the error-feedback residual and the optimizer time to settle at each
#: density while staying a small share of a real run.
DEFAULT_DENSITY_WARMUP_STEPS = 64
#: ``ddp_topk``'s plain all-reduce steps before compressing under an Adam-family optimizer: the second moment
#: estimate (``β₂ = 0.999``: a time constant of 1000 steps) must first see dense gradients, or the entries that are
#: sent rarely get huge normalised steps (1-bit Adam's lesson: compress after the variance has stabilised).
DEFAULT_ADAPTIVE_WARMUP_STEPS = 100


def _is_int(value: Any, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


@dataclass(kw_only=True)
class DDPCompressionConfig:
    """What :class:`~lightning_accel.strategies.ddp_compression.DDPCompressionStrategy` is given besides DDP's own
    arguments, checked in ``__post_init__``; the fields and their defaults are the strategy's ``Args``.

    ``use_error_feedback=None`` becomes its per-compression default (on, but off for QSGD), and ``start_iter=None``
    Top-K's and QSGD's (2 with error feedback, else 0).
    """

    compression: Compression
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1000
    min_compression_rate: float = 2.0
    use_error_feedback: bool | None = None
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    density: float = 0.01
    density_warmup_steps: int = DEFAULT_DENSITY_WARMUP_STEPS
    density_warmup: Sequence[float] | None = None
    momentum_correction: bool | None = None
    adaptive_warmup_steps: int = DEFAULT_ADAPTIVE_WARMUP_STEPS
    levels: int = 7
    chunk_size: int = 128
    start_iter: int | None = None
    seed: int = 0
    log_comm_stats: bool = True

    def __post_init__(self) -> None:
        compression = self.compression
        if compression not in _COMPRESSIONS:
            raise ValueError(
                f"DDPCompressionStrategy(compression={compression!r}): use one of "
                f"{', '.join(repr(c) for c in _COMPRESSIONS)}"
            )
        if self.use_error_feedback is None:
            self.use_error_feedback = compression != "qsgd"
        if compression == "powersgd":
            self._check_powersgd()
        if compression in ("topk", "qsgd"):
            if self.start_iter is None:
                self.start_iter = 2 if self.use_error_feedback else 0
            if not _is_int(self.start_iter, 0):
                raise ValueError(f"ddp_{compression}: start_iter={self.start_iter!r} must be an integer >= 0")
            if self.use_error_feedback and self.start_iter < 2:
                raise ValueError(
                    f"ddp_{compression}: start_iter={self.start_iter} must be >= 2 with error feedback (DDP "
                    "rebuilds its buckets after the first step); use start_iter=2 or more"
                )
        if compression == "topk":
            self._check_topk()
        if compression == "qsgd":
            self._check_qsgd()

    def _check_powersgd(self) -> None:
        rank, start, rate = self.matrix_approximation_rank, self.start_powerSGD_iter, self.min_compression_rate
        if not _is_int(rank, 1):
            raise ValueError(
                f"ddp_powersgd: matrix_approximation_rank={rank!r} must be an "
                "integer >= 1 (torch suggests 1, then 2, 4, ... until accuracy is satisfactory)"
            )
        if not _is_int(start, 0):
            raise ValueError(f"ddp_powersgd: start_powerSGD_iter={start!r} must be an integer >= 0")
        if (self.use_error_feedback or self.warm_start) and start < 2:
            raise ValueError(
                f"ddp_powersgd: start_powerSGD_iter={start} must be >= 2 with error "
                "feedback or warm start (DDP rebuilds its buckets after the first step); use >= 2"
            )
        if not isinstance(rate, (int, float)) or rate <= 0:
            raise ValueError(f"ddp_powersgd: min_compression_rate={rate!r} must be > 0, e.g. 2")

    def _check_topk(self) -> None:
        """The density and DGC's recipe (``ddp_topk``)."""
        density, warmup_steps, warmup = self.density, self.density_warmup_steps, self.density_warmup
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"ddp_topk: density={density!r} must be a fraction in (0, 1], e.g. 0.01 (1 % sent)")
        if not _is_int(warmup_steps, 0):
            raise ValueError(
                f"ddp_topk: density_warmup_steps={warmup_steps!r} must be an integer >= 0 (compressed steps per "
                f"warm-up stage, e.g. {DEFAULT_DENSITY_WARMUP_STEPS}; 0 turns the warm-up off)"
            )
        if warmup is not None:
            if isinstance(warmup, (str, bytes)) or not isinstance(warmup, Sequence):
                raise ValueError(
                    f"ddp_topk: density_warmup={warmup!r} must be a list of densities, e.g. [0.25, 0.0625, "
                    "0.015625], or None (DGC's ramp down to the target density)"
                )
            for d in warmup:
                if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
                    raise ValueError(
                        f"ddp_topk: density_warmup={list(warmup)!r} holds {d!r}: every stage's density must be a "
                        "fraction in (0, 1], e.g. [0.25, 0.0625, 0.015625]"
                    )
        if self.momentum_correction not in (None, True, False):
            raise ValueError(
                f"ddp_topk: momentum_correction={self.momentum_correction!r} must be None (automatic: on for SGD "
                "with momentum), True or False"
            )
        if self.momentum_correction and not self.use_error_feedback:
            raise ValueError(
                "ddp_topk: momentum_correction=True needs use_error_feedback=True (the velocity accumulates in the "
                "residual); drop use_error_feedback=False or set momentum_correction=None"
            )
        if not _is_int(self.adaptive_warmup_steps, 0):
            raise ValueError(
                f"ddp_topk: adaptive_warmup_steps={self.adaptive_warmup_steps!r} must be an integer >= 0 (plain "
                "all-reduce steps before compressing under Adam-family optimizers, e.g. "
                f"{DEFAULT_ADAPTIVE_WARMUP_STEPS})"
            )

    def _check_qsgd(self) -> None:
        levels, chunk_size, seed = self.levels, self.chunk_size, self.seed
        if not _is_int(levels, 1) or levels > 127:
            raise ValueError(f"ddp_qsgd: levels={levels!r} must be an integer in 1..127 (7 = 4 bits per entry)")
        if not _is_int(chunk_size, 1):
            raise ValueError(f"ddp_qsgd: chunk_size={chunk_size!r} must be an integer >= 1, e.g. 128")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"ddp_qsgd: seed={seed!r} must be an integer")
        variance = qsgd_variance_bound(levels, chunk_size)
        if self.use_error_feedback and variance >= 1:
            # error feedback needs a contractive compressor: the residual grows by that factor every step
            raise ValueError(
                f"ddp_qsgd: use_error_feedback=True with levels={levels}, chunk_size={chunk_size} "
                f"diverges (variance bound min(d/s², √d/s) = {variance:.2f} >= 1); use levels=127 "
                "or a smaller chunk_size, or error feedback off (QSGD is unbiased without it)"
            )

    @property
    def string(self) -> str:
        """The strategy string this configuration is registered under."""
        return f"ddp_{self.compression}{'_compress' if self.compression in ('fp16', 'bf16') else ''}"

    @property
    def powersgd_kwargs(self) -> dict[str, Any]:
        """The arguments of torch's ``PowerSGDState`` (besides its process group)."""
        return {
            "matrix_approximation_rank": self.matrix_approximation_rank,
            "start_powerSGD_iter": self.start_powerSGD_iter,
            "min_compression_rate": self.min_compression_rate,
            "use_error_feedback": self.use_error_feedback,
            "warm_start": self.warm_start,
            "orthogonalization_epsilon": self.orthogonalization_epsilon,
        }

    @property
    def hook_kwargs(self) -> dict[str, Any]:
        """The arguments of ``TopKState`` / ``QSGDState`` (besides the process group and what ``setup`` adds)."""
        out: dict[str, Any] = {"use_error_feedback": self.use_error_feedback, "start_iter": self.start_iter}
        if self.compression == "topk":
            out.update(
                density=float(self.density),
                density_warmup_steps=int(self.density_warmup_steps),
                density_warmup=None if self.density_warmup is None else tuple(float(d) for d in self.density_warmup),
            )
        elif self.compression == "qsgd":
            out.update(levels=self.levels, chunk_size=self.chunk_size, seed=self.seed)
        return out
