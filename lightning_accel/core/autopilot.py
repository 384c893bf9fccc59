"""The Autopilot's decisions as pure functions: the trial protocol, the noise floor, the keep rule, the numerics
guard, the compile pay-back rule, which fix to try for which finding, and the replayable plan.

Nothing here touches Lightning or runs a step: :class:`~lightning_accel.Autopilot` measures (with the doctor's
stage timer and rules) and calls these functions to decide, so every decision is unit-tested with exact numbers.

Sources of the guards (``docs/method.md``, "Closing the loop automatically"):

* measure on the run's own model and data, in windows long enough to mean something (Zeus: 10 warm-up + 40
  measured steps per setting; DeepSpeed Autotuning's 3-5 profiled steps are too short once compilation is
  involved);
* keep a change only above a gain threshold (DeepSpeed treats < 5 % as a plateau) *and* above the run's own
  measured noise (repeated windows of one configuration: the A/A spread);
* count compile time against the steps left in the fit; check numerics before keeping a change (loss on fixed
  batches, gradient direction).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_accel._atomic import atomic_open
from lightning_accel.core.batch import iter_tensors

__all__ = [
    "DEFAULT_TOLERANCES",
    "NUMERICS_KINDS",
    "PLAN_VERSION",
    "PRIOR_CONFIDENCE",
    "RULE_FIXES",
    "SHAPE_FIRST",
    "STAGE_FIXES",
    "AutopilotPlan",
    "Decision",
    "NumericsCheck",
    "ProbeResult",
    "SearchBudget",
    "Tolerance",
    "TrialRecord",
    "batch_digest",
    "EXPECTED_REMOVAL",
    "compare_probes",
    "compile_pays_back",
    "cosine",
    "decide",
    "expected_gain",
    "fix_gains",
    "prior_confidence",
    "prior_device",
    "propose",
    "rank_by_expected_gain",
    "relative_noise",
    "render_python",
    "render_yaml",
]

PLAN_VERSION = 1

# ------------------------------------------------------------------------------------------------ numerics
#: How a change may alter the numbers, which decides the tolerance its numerics check uses:
#: ``data`` changes only how batches are produced (the batches must be bit-identical); ``exact`` changes nothing
#: numerical beyond the last bit (e.g. a foreach optimizer); ``reorder`` reorders floating-point work (compiled or
#: fused kernels, a micro-batch split differently); ``low_precision`` computes in 16 bits.
NUMERICS_KINDS: tuple[str, ...] = ("data", "exact", "reorder", "low_precision")


@dataclass(frozen=True)
class Tolerance:
    """Largest relative loss difference and smallest gradient / update cosine a change may show on the probe.

    Args:
        max_loss_rel: ``|loss_new - loss_ref| / |loss_ref|`` allowed, per probe batch (the largest counts).
        min_grad_cosine: cosine between the flattened gradients of the two configurations at the same weights.
        min_update_cosine: cosine between the parameter updates of one optimizer step (checks optimizer changes).
    """

    max_loss_rel: float
    min_grad_cosine: float
    min_update_cosine: float

    def __post_init__(self) -> None:
        if not (isinstance(self.max_loss_rel, (int, float)) and self.max_loss_rel >= 0):
            raise ValueError(f"Tolerance(max_loss_rel={self.max_loss_rel!r}): give a fraction >= 0, e.g. 0.01")
        for name in ("min_grad_cosine", "min_update_cosine"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -1.0 <= value <= 1.0):
                raise ValueError(f"Tolerance({name}={value!r}): give a cosine in [-1, 1], e.g. 0.99")


#: Defaults per kind. ``data``: the batches themselves must be identical (checked on their bytes), so the numbers
#: are too. ``low_precision``: the method's "validation accuracy moving by more than ~0.5 % after AMP means
#: suspect precision", as a 1 % loss and 0.97 gradient-cosine bound on fixed batches.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "data": Tolerance(0.0, 1.0, 1.0),
    "exact": Tolerance(1e-5, 0.99999, 0.9999),
    "reorder": Tolerance(1e-3, 0.999, 0.99),
    "low_precision": Tolerance(0.01, 0.97, 0.9),
}


def batch_digest(batch: Any) -> str:
    """A fingerprint of every tensor in ``batch`` (dtype, shape and bytes): equal digests mean identical batches."""
    h = hashlib.sha256()
    for tensor in iter_tensors(batch):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class ProbeResult:
    """What one configuration computes on the fixed probe batches, at the same starting weights.

    Attributes:
        digests: :func:`batch_digest` of every probe batch as the configuration's loader delivered it.
        losses: the loss of every probe step (mean over its micro-batches).
        grad: all gradients of the first probe step, flattened (float64, CPU); ``None`` without gradients.
        update: the parameter change of the first probe step's optimizer step, flattened; ``None`` if not run.
    """

    digests: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad: torch.Tensor | None = None
    update: torch.Tensor | None = None


def cosine(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """Cosine similarity of two flat vectors (float64); 1.0 when both are zero, ``None`` when one is missing."""
    if a is None or b is None:
        return None
    if a.shape != b.shape:
        return -1.0  # different parameter sets: not the same direction by construction
    if torch.equal(a, b):
        return 1.0 if bool(a.isfinite().all()) else 0.0
    a, b = a.double(), b.double()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0 or not (math.isfinite(na) and math.isfinite(nb)):
        return 0.0
    return float(torch.dot(a, b) / (na * nb))


@dataclass(frozen=True)
class NumericsCheck:
    """The numerics guard's verdict on one change, with the numbers."""

    ok: bool
    kind: str
    reason: str
    loss_rel_diff: float | None = None
    grad_cosine: float | None = None
    update_cosine: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_probes(
    reference: ProbeResult,
    candidate: ProbeResult,
    kind: str,
    tolerance: Tolerance | None = None,
    *,
    same_batches: bool | None = None,
) -> NumericsCheck:
    """Whether ``candidate`` computes what ``reference`` computes, within the tolerance of ``kind``.

    ``data`` changes (and ``same_batches=True``: a bundle with a data-loading member) must deliver bit-identical
    batches; every kind must keep every probe loss within ``max_loss_rel`` and the gradient (and, where measured,
    the optimizer update) direction above the cosines.
    """
    if kind not in NUMERICS_KINDS:
        raise ValueError(f"numerics kind {kind!r} is unknown; kinds are {list(NUMERICS_KINDS)}")
    tol = tolerance or DEFAULT_TOLERANCES[kind]
    if same_batches is None:
        same_batches = kind == "data"
    if same_batches and reference.digests != candidate.digests:
        differ = [i for i, (a, b) in enumerate(zip(reference.digests, candidate.digests)) if a != b]
        if len(reference.digests) != len(candidate.digests):
            differ.append(min(len(reference.digests), len(candidate.digests)))
        return NumericsCheck(
            False,
            kind,
            f"the loader delivered different batches (probe batch {differ[0]} "
            "differs; e.g. augmentation seeded per worker): a data-loading change "
            "must not change the samples",
        )
    rel = None
    if reference.losses and candidate.losses:
        rels = []
        for a, b in zip(reference.losses, candidate.losses):
            if not (math.isfinite(a) and math.isfinite(b)):
                rels.append(0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else math.inf)
            else:
                rels.append(abs(b - a) / max(abs(a), 1e-12))
        rel = max(rels)
    grad_cos = cosine(reference.grad, candidate.grad)
    update_cos = cosine(reference.update, candidate.update)
    problems = []
    if rel is not None and rel > tol.max_loss_rel:
        problems.append(f"loss differs by {rel:.2e} (relative; allowed {tol.max_loss_rel:.0e})")
    if grad_cos is not None and grad_cos < tol.min_grad_cosine:
        problems.append(f"gradient cosine {grad_cos:.6f} < {tol.min_grad_cosine}")
    if update_cos is not None and update_cos < tol.min_update_cosine:
        problems.append(f"update cosine {update_cos:.6f} < {tol.min_update_cosine}")
    shown = []
    if rel is not None:
        shown.append(f"loss Δ {rel:.1e}")
    if grad_cos is not None:
        shown.append(f"grad cos {grad_cos:.6f}")
    if update_cos is not None:
        shown.append(f"update cos {update_cos:.4f}")
    if problems:
        return NumericsCheck(False, kind, "numerics guard: " + "; ".join(problems), rel, grad_cos, update_cos)
    return NumericsCheck(True, kind, ", ".join(shown) or "same batches", rel, grad_cos, update_cos)


# ------------------------------------------------------------------------------------------------ speed
def relative_noise(rates: Sequence[float]) -> float:
    """The spread of repeated windows of one configuration, ``(max - min) / median``; 0 with fewer than two."""
    values = [float(r) for r in rates if r is not None and math.isfinite(r) and r > 0]
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


@dataclass(frozen=True)
class Decision:
    """Whether a candidate's windows beat the current configuration's by more than the gate."""

    keep: bool
    ratio: float  #: median candidate rate ÷ median current rate
    gate: float  #: the gain needed: max(threshold, measured noise)
    reason: str


def decide(current: Sequence[float], candidate: Sequence[float], threshold: float) -> Decision:
    """Keep a candidate only when its median rate beats the current median by more than
    ``max(threshold, relative_noise(current))``: a gain inside the run's own window-to-window spread is noise."""
    if not current or not candidate:
        raise ValueError("decide() needs at least one window of each configuration")
    noise = relative_noise(current)
    gate = max(float(threshold), noise)
    ratio = statistics.median(candidate) / max(statistics.median(current), 1e-12)
    if ratio >= 1.0 + gate:
        return Decision(True, ratio, gate, f"{ratio:.2f}x beats the {1 + gate:.2f}x gate")
    why = "threshold" if gate == threshold else "measured noise"
    verb = "is inside" if ratio >= 1.0 else "does not beat"
    return Decision(False, ratio, gate, f"{ratio:.2f}x {verb} the {1 + gate:.2f}x gate ({why})")


def compile_pays_back(
    compile_seconds: float, step_seconds_before: float, step_seconds_after: float, steps_left: int | None
) -> tuple[bool, str]:
    """Whether compiling pays for itself within the fit: the time it saves over the steps left exceeds the time it
    took to compile (``steps_left=None``: unknown length, judged on the per-step gain alone)."""
    saved_per_step = step_seconds_before - step_seconds_after
    if saved_per_step <= 0:
        return False, "compiled steps are not faster"
    if steps_left is None:
        return True, "fit length unknown; compiled steps are faster"
    saved = saved_per_step * steps_left
    verdict = saved > compile_seconds
    return verdict, (
        f"saves {saved:.1f} s over the {steps_left} steps left vs {compile_seconds:.1f} s to compile"
        if verdict
        else f"would save {saved:.1f} s over the {steps_left} steps left, less than the {compile_seconds:.1f} s "
        "compiling takes"
    )


class SearchBudget:
    """Seconds the search may spend, counted on ``clock`` from ``started`` (default: construction)."""

    def __init__(
        self, seconds: float, clock: Callable[[], float] = time.perf_counter, started: float | None = None
    ) -> None:
        if not (isinstance(seconds, (int, float)) and seconds >= 0):
            raise ValueError(f"budget seconds must be >= 0, got {seconds!r}")
        self.seconds = float(seconds)
        self._clock = clock
        self._start = clock() if started is None else float(started)

    def spent(self) -> float:
        return self._clock() - self._start

    def left(self) -> float:
        return self.seconds - self.spent()

    def affords(self, estimate: float) -> bool:
        return estimate <= self.left()


# ------------------------------------------------------------------------------------------------ what to try
#: Fixes to trial for each finding of the doctor's rules (``lightning_accel.core.rules``), in order.
RULE_FIXES: dict[str, tuple[str, ...]] = {
    # a larger micro-batch (global batch fixed) also amortises the loader's per-batch cost (sampler, collate, IPC)
    "data_wait": ("dataloader", "prefetch", "micro_batch"),
    "gpu_utilisation": ("dataloader", "prefetch"),
    "num_workers_zero": ("dataloader",),
    "transfer": ("pin_memory", "prefetch"),
    "pin_memory_off": ("pin_memory",),
    "fp32_compute": ("precision", "tf32"),
    "tf32_off": ("tf32",),
    "optimizer": ("optimizer_fused", "optimizer_foreach"),
    "optimizer_not_foreach": ("optimizer_fused", "optimizer_foreach"),
    "communication": ("compression", "micro_batch"),
    "launch_bound": ("compile", "micro_batch"),
    "math_sdpa": ("fused_attention",),
    "hf_eager_attention": ("fused_attention",),
    "memory": ("activation_checkpointing",),
    # the compute findings of the doctor's attribution (core.compute_causes), first fix first
    "eager_attention": ("fused_attention", "compile"),
    "large_vocab_loss": ("compile",),
    "unfused_elementwise": ("compile",),
    "fp32_matmul": ("precision", "tf32"),
    "nchw_convolution": ("channels_last",),
    "python_loop": ("compile",),
    # not a rule of the doctor: the Autopilot's own, when accumulate_grad_batches > 1 (the method's batch lever:
    # the same global batch in fewer, larger calls, tried before the smells' fixes)
    "accumulation": ("micro_batch",),
}

#: Fixes for the stage holding the run back when no rule names one (e.g. a compute-bound step: the method's
#: compute fixes), in order of how often they pay off.
STAGE_FIXES: dict[str, tuple[str, ...]] = {
    "data": ("dataloader", "prefetch", "micro_batch"),
    "transfer": ("pin_memory", "prefetch"),
    "forward": ("precision", "tf32", "fused_attention", "compile", "micro_batch", "channels_last"),
    # under DDP the trial steps' backward includes the all-reduce not hidden behind it
    "backward": ("precision", "tf32", "fused_attention", "compile", "micro_batch", "compression", "channels_last"),
    "optimizer": ("optimizer_fused", "optimizer_foreach"),
    "communication": ("compression", "micro_batch"),
    "other": ("micro_batch",),
}


def propose(
    findings: Iterable[str],
    bottleneck: str | None,
    available: Iterable[str],
    tried: Iterable[str],
    shares: Mapping[str, float] | None = None,
    threshold: float = 0.05,
) -> list[str]:
    """Names of the fixes to try next, in order: those for the findings' rules (in the doctor's order), then those
    for the bottleneck stage, then those for the other stages by decreasing share (when no fix for the largest
    stage helps, the next one is where time goes); only ``available`` ones never ``tried`` before.

    A stage whose share is below ``threshold / (1 + threshold)`` is left out of that last group: removing it
    entirely could not make the step ``threshold`` faster."""
    available = list(available)
    done = set(tried)
    order: list[str] = []
    for rule in findings:
        order.extend(RULE_FIXES.get(rule, ()))
    if bottleneck is not None:
        order.extend(STAGE_FIXES.get(bottleneck, ()))
    floor = threshold / (1.0 + threshold)
    for stage in sorted(shares or {}, key=lambda s: -(shares or {})[s]):
        if (shares or {})[stage] >= floor:
            order.extend(STAGE_FIXES.get(stage, ()))
    out: list[str] = []
    for name in order:
        if name in available and name not in done and name not in out:
            out.append(name)
    return out


#: What each fix can remove, as a fraction of a stage's time: the prior that orders the candidates (expected gain
#: = stage share x this) and decides whether a trial can pay back. Sources: the method's figures (mixed
#: precision 1.5-2x on tensor cores; torch.compile 10-30 %; FlashAttention several x on the attention itself,
#: taken as a quarter of the compute; fused optimizer kernels remove most of a for-loop step; workers hide nearly
#: all of an in-process data wait) and CPU measurements (benchmarks/bench_autopilot.py and bench_autopilot_real.py:
#: bf16 autocast rarely pays on CPU; the micro-batch amortises per-call costs). ``cuda`` / ``cpu`` override per
#: device type.
EXPECTED_REMOVAL: dict[str, dict[str, Any]] = {
    # on a CPU a loader worker takes a core from the step's own threads (on 2 cores: not kept on the GPT-2 and
    # Llama scripts of bench_autopilot_real.py at micro-batch <= 8, 2.25x on a sleeping dataset)
    "dataloader": {"data": 0.9, "cpu": {"data": 0.5}},
    # on a CPU there is no host-to-device copy to overlap, only loading in a thread that shares the cores
    "prefetch": {"data": 0.5, "transfer": 0.5, "cpu": {"data": 0.15, "transfer": 0.0}},
    "pin_memory": {"transfer": 0.5},
    # fewer, larger calls: the per-call cost of forward/backward and of collating batches; the optimizer still
    # steps once per global batch
    "micro_batch": {"data": 0.1, "forward": 0.25, "backward": 0.25, "other": 0.3},
    "optimizer_fused": {"optimizer": 0.6},
    "optimizer_foreach": {"optimizer": 0.5},
    # on a CPU without bf16 in hardware autocast emulates it (rarely pays); with it (``cpu+bf16``: AVX512-BF16 /
    # AMX / Arm BF16) bf16 takes 1.2-1.6x off the GPT-2 and Llama steps of bench_autopilot_real.py at micro-batch 32
    "precision": {
        "forward": 0.4,
        "backward": 0.4,
        "cpu": {"forward": 0.1, "backward": 0.1},
        "cpu+bf16": {"forward": 0.3, "backward": 0.3},
    },
    "tf32": {"forward": 0.3, "backward": 0.3},
    "compile": {"forward": 0.2, "backward": 0.2},
    "fused_attention": {"forward": 0.25, "backward": 0.25},
    # the convolutions are a part of forward + backward; NHWC takes ~1/6 off them (core.compute_causes)
    "channels_last": {"forward": 0.08, "backward": 0.08},
    "activation_checkpointing": {"forward": 0.1, "backward": 0.1},
    "compression": {"communication": 0.5, "backward": 0.1},
}


def prior_device(device_type: str) -> str:
    """The key of :data:`EXPECTED_REMOVAL`'s per-device overrides for a device type: ``"cpu+bf16"`` for a CPU with
    bf16 matrix multiplies in hardware (``core.precision.cpu_has_native_bf16``), else the type itself."""
    if device_type == "cpu":
        from lightning_accel.core.precision import cpu_has_native_bf16

        return "cpu+bf16" if cpu_has_native_bf16() else "cpu"
    return device_type


def expected_gain(name: str, shares: Mapping[str, float], device_type: str | None = None) -> float | None:
    """The fraction of the step fix ``name`` is expected to remove (:data:`EXPECTED_REMOVAL` x the stage shares);
    ``None`` for a fix without a prior (one of the user's own). ``device_type``: ``"cuda"``, ``"cpu"``, or
    ``"cpu+bf16"`` for a CPU with bf16 in hardware (:func:`prior_device`)."""
    table = EXPECTED_REMOVAL.get(name)
    if table is None:
        return None
    fractions = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
    # "cpu+bf16" takes the "cpu" overrides, then its own
    parts = (device_type or "").split("+")
    for key in ("+".join(parts[: i + 1]) for i in range(len(parts))):
        override = table.get(key)
        if isinstance(override, Mapping):
            fractions.update(override)
    return min(0.95, sum(float(shares.get(stage, 0.0)) * float(fraction) for stage, fraction in fractions.items()))


#: How far a prior can be counted on when deciding whether a short fit repays a search, per fix and device (1.0 where
#: not listed). bf16 on a CPU with it in hardware is a bet on large matmuls: in ``bench_autopilot_real.py`` on a 2-core
#: CPU it measures 1.2-1.6x on the GPT-2 and Llama scripts at micro-batch 32, 0.87-1.01x at micro-batch 4 and 0.905x on
#: the balanced 300-step fit of ``--short`` (searching for it costs that fit 0.89x vanilla's wall time): it pays about
#: half the time. The ranking (:func:`rank_by_expected_gain`) keeps the prior itself: a long fit still tries bf16 early.
PRIOR_CONFIDENCE: dict[str, dict[str, float]] = {"precision": {"cpu+bf16": 0.5}}


def prior_confidence(name: str, device_type: str | None = None) -> float:
    """The share of fix ``name``'s expected gain a pay-back decision counts on ``device_type``
    (:data:`PRIOR_CONFIDENCE`; 1.0 where the prior is not a bet)."""
    return PRIOR_CONFIDENCE.get(name, {}).get(device_type or "", 1.0)


#: Fixes that change the shape of the work go before the others, whatever their priors: every other fix is
#: measured at the micro-batch it runs at, and once (a refused fix is not asked again). On the GPT-2 script of
#: bench_autopilot_real.py (4 x 8) bf16 tried first measures 0.87-1.01x and would not be asked again; after the
#: jump to 32 x 1 it measures 1.2-1.6x.
SHAPE_FIRST: tuple[str, ...] = ("micro_batch",)


def fix_gains(findings: Iterable[Any]) -> dict[str, float]:
    """What the compute attribution says each fix would save (a share of the step): every compute finding's
    ``saving`` credited to the first fix :data:`RULE_FIXES` names for its rule, summed per fix (``compile`` fuses
    the chains and the loop alike), at most 0.95."""
    gains: dict[str, float] = {}
    for f in findings:
        fixes = RULE_FIXES.get(f.rule, ())
        if getattr(f, "kind", None) != "compute" or f.saving is None or not fixes:
            continue
        gains[fixes[0]] = min(0.95, gains.get(fixes[0], 0.0) + float(f.saving))
    return gains


def rank_by_expected_gain(
    names: Sequence[str],
    shares: Mapping[str, float],
    device_type: str | None = None,
    measured: Mapping[str, float] | None = None,
) -> list[str]:
    """``names`` by decreasing expected gain, :data:`SHAPE_FIRST` ahead; fixes without a prior keep their place
    after those with one; ties keep the given order (the doctor's findings first). ``measured``: gains the compute
    attribution found (:func:`fix_gains`), which replace those fixes' priors."""
    measured = measured or {}

    def gain(n: str) -> float | None:
        return measured[n] if n in measured else expected_gain(n, shares, device_type)

    order = {n: i for i, n in enumerate(names)}
    known = [n for n in names if gain(n) is not None]
    unknown = [n for n in names if n not in known]
    known.sort(key=lambda n: (n not in SHAPE_FIRST, -round(gain(n) or 0.0, 4), order[n]))
    return known + unknown


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class TrialRecord:
    """One row of the Autopilot's table."""

    index: int
    name: str
    change: str
    samples_per_sec: float | None
    vs_baseline: float | None
    kept: bool
    reason: str
    numerics: dict[str, Any] | None = None
    seconds: float = 0.0
    shares: dict[str, float] | None = None
    #: mean paired ratio B/A against the configuration it was trialled against
    ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AutopilotPlan:
    """What the search chose, replayable by ``Autopilot(plan=path)``: the kept changes in the order they were
    applied (``name`` + ``params``), with the measurements that justified them."""

    kept: list[dict[str, Any]] = field(default_factory=list)
    trials: list[dict[str, Any]] = field(default_factory=list)
    baseline_samples_per_sec: float | None = None
    final_samples_per_sec: float | None = None
    #: the claimed speed-up of the kept set over the untouched configuration, its 90 % interval and its source
    #: (``"final A/B"`` or ``"trials"``: see ``AutopilotSearch``); absent in plans written before it was measured
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_source: str | None = None
    noise: float | None = None
    search_seconds: float | None = None
    world_size: int = 1
    model: str | None = None
    stopped: str | None = None
    yaml: str = ""
    python: str = ""
    version: int = PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON atomically (a temporary file renamed into place: never a half-written plan)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(target, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2, default=_json_default)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AutopilotPlan:
        """Read a plan written by :meth:`save`; a missing file, bad JSON or a foreign layout raises ``ValueError``
        naming the file and what is wrong."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"Autopilot(plan={str(path)!r}): no such file; run once without `plan=` to write one "
                "(it goes to `save_plan`, default <default_root_dir>/autopilot_plan.json)"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(f"Autopilot(plan={str(path)!r}) is not valid JSON: {err}") from None
        if not isinstance(data, Mapping) or not isinstance(data.get("kept"), list):
            raise ValueError(f"Autopilot(plan={str(path)!r}) is not an Autopilot plan (no 'kept' list)")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(
                f"Autopilot(plan={str(path)!r}) has version {data.get('version')!r}; this "
                f"lightning-accel reads version {PLAN_VERSION}: search again without `plan=`"
            )
        for i, entry in enumerate(data["kept"]):
            if (
                not isinstance(entry, Mapping)
                or not isinstance(entry.get("name"), str)
                or not isinstance(entry.get("params", {}), Mapping)
            ):
                raise ValueError(
                    f"Autopilot(plan={str(path)!r}): kept[{i}] needs a 'name' and a 'params' mapping, got {entry!r}"
                )
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _json_default(value: Any) -> Any:
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if (
        text == ""
        or any(c in text for c in ":#{}[],&*?|<>=!%@`'\"")
        or text.strip() != text
        or text.lower() in ("true", "false", "null", "yes", "no", "on", "off")
    ):
        return json.dumps(text)
    return text


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, Mapping):
        for key, sub in value.items():
            if isinstance(sub, (Mapping, list)) and sub:
                lines.append(f"{pad}{key}:")
                lines.extend(_yaml_lines(sub, indent + 2))
            else:
                lines.append(f"{pad}{key}: {_yaml_scalar(sub) if not isinstance(sub, (Mapping, list)) else '{}'}")
    elif isinstance(value, list):
        for item in value:
            sub = _yaml_lines(item, indent + 2)
            if isinstance(item, (Mapping, list)) and sub:
                lines.append(f"{pad}- {sub[0].lstrip()}")
                lines.extend(sub[1:])
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
    else:
        lines.append(pad + _yaml_scalar(value))
    return lines


def render_yaml(entries: Sequence[tuple[str, Any]]) -> str:
    """A LightningCLI config fragment from ``(dotted.key, value)`` pairs. Values under one key merge: lists
    concatenate (``trainer.callbacks``), mappings update, scalars take the last value."""
    tree: dict[str, Any] = {}
    for dotted, value in entries:
        parts = dotted.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        leaf = parts[-1]
        if isinstance(value, list) and isinstance(node.get(leaf), list):
            node[leaf] = node[leaf] + value
        elif isinstance(value, Mapping) and isinstance(node.get(leaf), Mapping):
            node[leaf] = {**node[leaf], **value}
        else:
            node[leaf] = value
    return "\n".join(_yaml_lines(tree, 0)) + ("\n" if tree else "")


def render_python(lines: Sequence[str]) -> str:
    """The Python snippet: each kept change's lines, in order, de-duplicated."""
    out: list[str] = []
    for line in lines:
        if line not in out:
            out.append(line)
    return "\n".join(out) + ("\n" if out else "")
