"""The findings' data model: stages, thresholds, run facts, findings, skipped rules, diagnoses.

Plain data shared by every rule family — the step rules (:mod:`lightning_accel.core.rules`), the fit rules
(:mod:`lightning_accel.core.phases`), stragglers (:mod:`lightning_accel.core.ranks`), variability
(:mod:`lightning_accel.core.variability`) and code smells (:mod:`lightning_accel.core.smells`) — and by the report.
:mod:`lightning_accel.core.rules` re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, cast

__all__ = ["STAGES", "Diagnosis", "Finding", "RunContext", "SkippedRule", "Thresholds", "by_saving"]

#: The stages of a training step, in the order a step runs them.
STAGES: tuple[str, ...] = ("data", "transfer", "forward", "backward", "optimizer", "communication", "other")


@dataclass(frozen=True)
class Thresholds:
    """Where each rule fires. Shares and fractions are in [0, 1] (0.10 = 10 % of the step time).

    Args:
        data_share: ``data`` share above which the input pipeline is the finding (default 0.10).
        gpu_utilisation: GPU utilisation (NVML, fraction of time a kernel ran) below which the device is
            underfed (default 0.90).
        transfer_share: ``transfer`` share above which the host→device copy is the finding (default 0.10).
        compute_share: ``forward + backward`` share from which the run counts as compute-bound, for the
            mixed-precision and launch-bound rules (default 0.50).
        optimizer_share: ``optimizer`` share above which the optimizer step is the finding (default 0.25).
        communication_share: ``communication`` share above which the all-reduce is the finding (default 0.15).
        memory_fraction: device memory peak ÷ capacity from which memory is "near capacity" (default 0.90).
        small_batch: per-device batch at or below which a batch counts as small (default 8).
        mfu_per_compute: MFU ÷ compute share below which the compute stages are launch-bound (default 0.30).
        validation_share: validation's share of the fit (after start-up) above which it is a fit finding
            (default 0.20).
        checkpoint_share: checkpoint saving's share of the fit (after start-up) above which it is a fit finding
            (default 0.10).
        straggler_share: how much longer one rank's batch takes outside the all-reduce than the other ranks',
            as a fraction of the mean step, from which it is a straggler (default 0.10).
        variability: p95 ÷ p5 of the batch times above which step times count as variable (default 2.0).
    """

    data_share: float = 0.10
    gpu_utilisation: float = 0.90
    transfer_share: float = 0.10
    compute_share: float = 0.50
    optimizer_share: float = 0.25
    communication_share: float = 0.15
    memory_fraction: float = 0.90
    small_batch: int = 8
    mfu_per_compute: float = 0.30
    validation_share: float = 0.20
    checkpoint_share: float = 0.10
    straggler_share: float = 0.10
    variability: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "variability":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value <= 1.0:
                    raise ValueError(
                        f"thresholds: variability={value!r} must be a ratio p95/p5 of step times above 1, e.g. 2.0"
                    )
                continue
            if f.name == "small_batch":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"thresholds: small_batch={value!r} must be a positive integer batch size, e.g. 8")
                continue
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or math.isnan(value)
                or not 0.0 < value < 1.0
            ):
                raise ValueError(
                    f"thresholds: {f.name}={value!r} must be a fraction strictly between 0 and 1 "
                    f"(e.g. {f.default} for {100 * cast(float, f.default):.0f} %)"
                )

    @classmethod
    def from_kwargs(cls, **overrides: Any) -> Thresholds:
        """Defaults with ``overrides``; an unknown name raises ``ValueError`` listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown threshold(s) {unknown}; known: {sorted(known)}")
        return cls(**overrides)


@dataclass
class RunContext:
    """What is known about the run besides the stage shares. ``None`` means unknown: rules needing it are skipped.

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ``"mps"``, ...
        device_name: e.g. ``"NVIDIA H100 80GB HBM3"``.
        device_capability: CUDA compute capability, e.g. ``(9, 0)``.
        compute_dtype: the matmul dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``, ...).
        world_size: number of data-parallel processes.
        num_workers / pin_memory / prefetch_factor / persistent_workers: the training DataLoader's settings.
        loader: what feeds the training step: ``"DataLoader"``, ``"DALIImageDataModule"``, or ``None`` (unknown).
        decode_device / loader_threads / prefetch_queue_depth: a DALI pipeline's settings (``"cpu"`` or
            ``"mixed"``; its CPU threads; the batches it prepares ahead).
        cpu_count: CPU cores this process may use (for the ``num_workers`` suggestion).
        batch_size: per-device samples per batch.
        accumulate_grad_batches: micro-batches per optimizer step.
        optimizer: optimizer class name; ``optimizer_fused`` / ``optimizer_foreach`` its flags when it has them.
        gpu_utilisation: mean NVML GPU utilisation over the measured windows (fraction).
        memory_peak_fraction: peak allocated device memory ÷ device capacity.
        mfu: model FLOPs utilisation (from ``MFUMonitor``).
        sdpa_backend: the scaled-dot-product-attention kernel seen (``flash``, ``efficient``, ``cudnn``,
            ``math``), or ``None`` when the model ran no SDPA or it was not observed.
        communication_measured: whether the gradient all-reduce was timed (a DDP comm hook ran).
        log_every_n_steps: the Trainer's logging cadence.
        val_check_interval / check_val_every_n_epoch / limit_val_batches: the Trainer's validation settings
            (an int ``val_check_interval`` counts training batches, a float is a fraction of the epoch).
        checkpoint_every_n_train_steps: the ``ModelCheckpoint``'s step cadence (``None``: not by steps).
        async_checkpoint: whether checkpoints are written by ``AsyncCheckpointIO`` (a background thread).
        nchw_convolutions: module paths of the 2-D convolutions whose weights are in NCHW (the default memory
            format, not ``channels_last``); ``None`` when not looked at.
    """

    device_type: str | None = None
    device_name: str | None = None
    device_capability: tuple[int, int] | None = None
    compute_dtype: str | None = None
    world_size: int | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    loader: str | None = None
    decode_device: str | None = None
    loader_threads: int | None = None
    prefetch_queue_depth: int | None = None
    cpu_count: int | None = None
    batch_size: int | None = None
    accumulate_grad_batches: int | None = None
    optimizer: str | None = None
    optimizer_fused: bool | None = None
    optimizer_foreach: bool | None = None
    gpu_utilisation: float | None = None
    memory_peak_fraction: float | None = None
    mfu: float | None = None
    sdpa_backend: str | None = None
    communication_measured: bool | None = None
    log_every_n_steps: int | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = None
    limit_val_batches: float | None = None
    checkpoint_every_n_train_steps: int | None = None
    async_checkpoint: bool | None = None
    nchw_convolutions: tuple[str, ...] | None = None

    @property
    def threaded_pipeline(self) -> bool:
        """The training data comes from a pipeline of threads in this process (DALI), not DataLoader workers."""
        return self.loader not in (None, "DataLoader")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.device_capability is not None:
            out["device_capability"] = list(self.device_capability)
        if self.nchw_convolutions is not None:
            out["nchw_convolutions"] = list(self.nchw_convolutions)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunContext:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("device_capability") is not None:
            values["device_capability"] = tuple(values["device_capability"])
        if values.get("nchw_convolutions") is not None:
            values["nchw_convolutions"] = tuple(values["nchw_convolutions"])
        return cls(**values)


@dataclass(frozen=True)
class Finding:
    """One diagnosed problem: which stage, the numbers that show it, and the concrete change that fixes it.

    Attributes:
        rule: stable rule id. Step rules (:func:`~lightning_accel.core.rules.diagnose`): ``data_wait``,
            ``gpu_utilisation``, ``transfer``, ``fp32_compute``, ``optimizer``, ``communication``, ``memory``,
            ``launch_bound``, ``math_sdpa``, ``straggler``, ``step_variability``, ``pipeline_bubble`` (pp strategies); fit rules
            (:func:`~lightning_accel.core.phases.diagnose_fit`): ``validation_heavy``, ``checkpoint_heavy``; code
            smells (:func:`~lightning_accel.core.smells.find_smells`): see :data:`~lightning_accel.core.smells.SMELLS`.
        stage: the stage it holds back (one of :data:`STAGES`), or for a fit finding the fit phase
            (``validation``, ``checkpoint``).
        evidence: the measured numbers, as a sentence.
        fix: what to change, naming the lightning-accel component where one applies.
        value: the number the rule compared (a share or fraction), for rate-limiting and comparisons.
        gain: the measured speed-up of the fix (old time ÷ new time) where it was previewed, else ``None``.
        kind: ``"step"`` (from the stage shares), ``"fit"`` (fit phases), ``"smell"`` (static, before the
            first step) or ``"compute"`` (from the compute attribution: a module and its fix).
        saving: the share of the time that fixing it would save (the time its cause takes now, or for a fix that
            speeds a stage up rather than removing it, the rule's estimate of what it takes off; each rule says
            which); findings are shown largest saving first (:func:`by_saving`). Of the step time for a step
            finding (:func:`~lightning_accel.core.rules.diagnose`, stragglers, variability), of the fit after
            start-up for a fit finding and for every finding of a report that measured the fit
            (:func:`~lightning_accel.core.verdict.build_report` rescales the step findings by the training's share
            of that fit). ``None`` where the rule cannot say (the gain of a larger batch, the attention's share).
        module: the module path the finding is about (``model.blocks.3.attn``) for a compute finding
            (``kind="compute"``, :mod:`lightning_accel.core.compute_causes`), else ``None``.
    """

    rule: str
    stage: str
    evidence: str
    fix: str
    value: float
    gain: float | None = None
    kind: str = "step"
    saving: float | None = None
    module: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        gain, saving = data.get("gain"), data.get("saving")
        return cls(
            rule=str(data["rule"]),
            stage=str(data["stage"]),
            evidence=str(data["evidence"]),
            fix=str(data["fix"]),
            value=float(data["value"]),
            gain=None if gain is None else float(gain),
            kind=str(data.get("kind", "step")),
            saving=None if saving is None else float(saving),
            module=None if data.get("module") is None else str(data["module"]),
        )

    def __str__(self) -> str:
        return f"[{self.stage}] {self.evidence} Fix: {self.fix}"


def by_saving(findings: Iterable[Finding]) -> list[Finding]:
    """Findings largest :attr:`~Finding.saving` first, so the first is the fix that saves the most; those that
    cannot say what they save (``None``) follow, in their given order (the sort is stable)."""
    return sorted(findings, key=lambda f: (f.saving is None, -(f.saving or 0.0)))


@dataclass(frozen=True)
class SkippedRule:
    """A rule that could not be evaluated, and why (e.g. ``gpu_utilisation``: no GPU in use)."""

    rule: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Diagnosis:
    """The result of :func:`~lightning_accel.core.rules.diagnose` (and the other rule families): findings (largest
    saving first) and the rules that were skipped."""

    findings: list[Finding] = field(default_factory=list)
    skipped: list[SkippedRule] = field(default_factory=list)
