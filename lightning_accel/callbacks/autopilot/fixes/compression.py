"""Compressed gradient all-reduce under plain DDP (:class:`Compression`): the switchable comm hook it registers
(:class:`SwitchableCompression`), the link measurement (:func:`measure_link`) and the projection's choice of
bf16 / Top-K / QSGD (:func:`choose_compression`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = [
    "COMPRESSION_STRATEGIES",
    "MIN_PROJECTED_GAIN",
    "Compression",
    "SwitchableCompression",
    "choose_compression",
    "measure_link",
]


class SwitchableCompression:
    """A DDP comm hook whose compression can change between steps: torch's ``allreduce_hook`` (the plain averaged
    all-reduce), ``bf16_compress_hook``, ``fp16_compress_hook``, or the collection's ``topk_hook`` / ``qsgd_hook``
    (``strategies/compression_hooks.py``, the hooks of ``ddp_topk`` / ``ddp_qsgd`` with those strategies' default
    knobs). DDP accepts one comm hook per model and cannot remove it, so the Autopilot registers this one the first
    time it trials compression and switches it.

    The Top-K / QSGD states start compressing at once (``start_iter=0``: the Autopilot trials after its baseline
    steps, when DDP has rebuilt its buckets, which is what the strategies' 2-step warm-up waits for)."""

    MODES: ClassVar[tuple[str, ...]] = ("allreduce", "bf16", "fp16", "topk", "qsgd")

    def __init__(self) -> None:
        self.mode = "allreduce"
        self._states: dict[str, Any] = {}

    def state(self, mode: str) -> Any:
        """The :class:`~lightning_accel.strategies.compression_hooks.TopKState` / ``QSGDState`` of ``mode``
        (made on first use; ``None`` for the stateless modes)."""
        if mode not in ("topk", "qsgd"):
            return None
        if mode not in self._states:
            from lightning_accel.strategies import compression_hooks as ch

            self._states[mode] = (
                ch.TopKState(density=0.01, start_iter=0) if mode == "topk" else ch.QSGDState(levels=7, start_iter=0)
            )
        return self._states[mode]

    def residuals(self) -> dict[str, dict[int, torch.Tensor]]:
        """The error-feedback residuals the stateful modes hold, by mode (what a revert clears)."""
        return {mode: dict(state.error_dict) for mode, state in self._states.items()}

    def clear_residuals(self) -> None:
        """Drop the unsent residuals (a revert: the part of the gradient Top-K has not sent yet is lost)."""
        for state in self._states.values():
            state.error_dict.clear()

    def hook(self) -> Callable[..., Any]:
        """The function to register (DDP checks its signature: no annotations other than torch's own)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from lightning_accel.strategies import compression_hooks as ch

        hooks = {
            "allreduce": default_hooks.allreduce_hook,
            "bf16": default_hooks.bf16_compress_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "topk": ch.topk_hook,
            "qsgd": ch.qsgd_hook,
        }

        def switchable(state, bucket):
            own = self.state(self.mode)
            return hooks[self.mode](own if own is not None else state, bucket)

        return switchable


#: The strategy string that gives each compression mode by hand (and in a replayed plan).
COMPRESSION_STRATEGIES: dict[str, str] = {
    "bf16": "ddp_bf16_compress",
    "fp16": "ddp_fp16_compress",
    "topk": "ddp_topk",
    "qsgd": "ddp_qsgd",
}

#: A Top-K / QSGD hook is chosen over bf16 only when the projection puts its step at least this much faster.
MIN_PROJECTED_GAIN = 0.05


def choose_compression(*, n: int, link: Any, params: int, step_s: float) -> tuple[str, str]:
    """The compression mode for ``n`` ranks on ``link`` from ``core.scaling.project_scaling``: ``"topk"`` or
    ``"qsgd"`` where its projected step beats ``ddp_bf16_compress``'s by :data:`MIN_PROJECTED_GAIN` (their
    all-gathered bytes grow with ``n``: they pay on slow links with few ranks), else ``"bf16"``.

    Args:
        n: ranks of the gradient all-reduce.
        link: a :class:`~lightning_accel.core.scaling.Interconnect` or preset name.
        params: gradient entries (fp32) reduced per step.
        step_s: the measured step seconds (the compute that hides the communication).

    Returns:
        ``(mode, why)``: the mode and the projection that chose it, in words.
    """
    from lightning_accel.core.scaling import ScalingWorkload, get_interconnect, project_scaling

    link = get_interconnect(link)
    workload = ScalingWorkload(compute_s=max(step_s, 1e-9), params=max(1, int(params)))
    points = {
        p.strategy: p
        for p in project_scaling(workload, link, n=[n], strategies=("ddp_bf16_compress", "ddp_topk", "ddp_qsgd"))
    }
    bf16 = points["ddp_bf16_compress"]
    best = min(("ddp_topk", "ddp_qsgd"), key=lambda s: (points[s].step_s, points[s].comm_s))
    ms = {s: f"{p.step_s * 1e3:.3g}" for s, p in points.items()}
    why = (
        f"projected step (ms) on {link.name} ({link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} µs), "
        f"{n} ranks: bf16 {ms['ddp_bf16_compress']}, topk {ms['ddp_topk']}, qsgd {ms['ddp_qsgd']}"
    )
    if points[best].step_s < (1 - MIN_PROJECTED_GAIN) * bf16.step_s:
        return best.removeprefix("ddp_"), why
    return "bf16", why


def measure_link(run: Run) -> Any:
    """The run's gradient link, fitted (``core.scaling.fit_interconnect``) from timed all-reduces of 256 KiB and
    4 MiB on its process group, each rank's slowest of 3 taken over all ranks (so every rank chooses alike)."""
    import time

    import torch.distributed as dist

    from lightning_accel.callbacks._fit.trainer_state import gather_floats
    from lightning_accel.core.scaling import fit_interconnect

    sizes = [256 * 2**10, 4 * 2**20]
    local = []
    for size in sizes:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=run.device)
        dist.all_reduce(buffer)  # warm-up
        times = []
        for _ in range(3):
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            times.append(time.perf_counter() - start)
        local.append(sorted(times)[1])
    rows = gather_floats(run.trainer, run.device, local, what="Autopilot compression link measurement")
    seconds = [float(rows[:, i].max()) for i in range(len(sizes))]
    try:
        return fit_interconnect(sizes, seconds, run.trainer.world_size, name="measured")
    except ValueError:  # times that do not grow with size: latency-bound, call it a fast link
        from lightning_accel.core.scaling import Interconnect

        return Interconnect("measured", 1e12, max(0.0, min(seconds)) / (2 * (run.trainer.world_size - 1)))


class Compression(Intervention):
    """Compressed gradient all-reduce under plain Lightning DDP, trialled when the backward (which includes the
    exposed all-reduce in the Autopilot's trial steps) holds the run back: 16 bits (``ddp_bf16_compress``'s hook),
    or Top-K / QSGD (``ddp_topk`` / ``ddp_qsgd``'s hooks) where ``core.scaling.project_scaling`` puts them ahead
    on the run's link and rank count (:func:`choose_compression`; the link is measured with a few all-reduces
    unless ``interconnect=`` names a preset). The numerics probe runs through the DDP wrapper here, so the
    compressed all-reduce is what it checks (Top-K's error feedback evens out over steps, a one-step probe sees the
    sparse gradient: it refuses a Top-K the tolerance cannot take, and bf16 is trialled next, see
    :meth:`fallback`). If the trial is not kept, the registered hook
    stays as torch's plain averaged all-reduce for the fit (the same sums, reduced in Python instead of DDP's
    built-in reducer): DDP cannot unregister a hook; Top-K's unsent residual is dropped.

    Args:
        compression: ``"bf16"``, ``"fp16"``, ``"topk"`` or ``"qsgd"`` (a replayed plan); default: chosen as above.
        interconnect: a ``core.scaling`` preset name for the choice instead of the measured link.
    """

    name = "compression"
    kind = "low_precision"
    knobs = ("strategy",)
    probe_through_strategy = True

    def __init__(self, **params: Any) -> None:
        mode = params.get("compression")
        if mode is not None and mode not in COMPRESSION_STRATEGIES:
            raise ValueError(
                f"Compression(compression={mode!r}): use one of {', '.join(COMPRESSION_STRATEGIES)} "
                "(or leave it out: chosen from the scaling projection)"
            )
        link = params.get("interconnect")
        if link is not None:
            from lightning_accel.core.scaling import get_interconnect

            get_interconnect(link)  # an unknown preset fails here, naming the presets
        super().__init__(**params)
        self.why: str | None = None

    def unavailable(self, run: Run) -> str | None:
        from lightning.pytorch.strategies import DDPStrategy
        from torch.nn.parallel import DistributedDataParallel

        from lightning_accel.strategies.ddp_compression import DDPCompressionStrategy

        if run.trainer.world_size <= 1:
            return "single process: no gradient all-reduce"
        strategy = run.trainer.strategy
        if isinstance(strategy, DDPCompressionStrategy):
            return f"the strategy already compresses ({strategy.compression})"
        if not isinstance(strategy, DDPStrategy) or not isinstance(strategy.model, DistributedDataParallel):
            return f"{type(strategy).__name__} is not plain DDP"
        return None

    def _choose(self, run: Run) -> str:
        link = self.params.get("interconnect") or measure_link(run)
        window = run.current or run.baseline
        step_s = window.step_seconds if window is not None and window.steps else 1e-3
        params = sum(p.numel() for p in run.module.parameters() if p.requires_grad)
        mode, self.why = choose_compression(n=run.trainer.world_size, link=link, params=params, step_s=step_s)
        return mode

    def change(self, run: Run, undo: Undo) -> None:
        switch = run.extras.get("comm_switch")
        if switch is None:
            switch = SwitchableCompression()
            try:
                run.trainer.strategy.model.register_comm_hook(None, switch.hook())
            except RuntimeError as err:
                raise ValueError(
                    f"the DDP model has a comm hook already ({err}); use strategy='ddp_bf16_compress' to compress"
                ) from err
            run.extras["comm_switch"] = switch
        mode = self.params.get("compression") or self._choose(run)
        self.params = {"compression": mode}
        before = switch.mode

        def revert() -> None:
            switch.mode = before
            switch.clear_residuals()  # the unsent residual is lost (a lossy change, checked by the probe)

        undo.push(revert)
        switch.mode = mode

    def fallback(self) -> Compression | None:
        """After a trial that was not kept: bf16 where the projection had chosen Top-K / QSGD (its one-step
        gradient is what the probe refuses most often), else nothing."""
        if self.why is not None and self.params.get("compression") in ("topk", "qsgd"):
            return Compression(compression="bf16")
        return None

    def describe(self, run: Run) -> str:
        name = COMPRESSION_STRATEGIES[self.params.get("compression", "bf16")]
        return f"strategy={name!r}" + (f" ({self.why})" if self.why else "")

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        name = COMPRESSION_STRATEGIES[self.params["compression"]]
        return [("trainer.strategy", name)], [f"trainer_kwargs['strategy'] = {name!r}  # after import lightning_accel"]
