"""What to try: the fixes each finding and stage names, the priors that order them (what each fix can remove of a
stage), and the proposal that assembles them for the current stage shares."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

from lightning_accel.core.findings import Finding, RunContext

__all__ = [
    "EXPECTED_REMOVAL",
    "PRIOR_CONFIDENCE",
    "RULE_FIXES",
    "SHAPE_FIRST",
    "STACKED_LAST",
    "STAGE_FIXES",
    "Proposal",
    "attribution_share",
    "expected_gain",
    "fix_gains",
    "prior_confidence",
    "prior_device",
    "propose",
    "proposal",
    "rank_by_expected_gain",
]

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
    # compile is credited with the finding's saving (it fuses the passes over the logits); the fused loss's gain is
    # mostly memory, and its time is measured like any other
    "large_vocab_loss": ("compile", "fused_cross_entropy"),
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
    "forward": ("precision", "tf32", "fused_attention", "compile", "micro_batch", "channels_last", "float8"),
    # under DDP the trial steps' backward includes the all-reduce not hidden behind it
    "backward": (
        "precision",
        "tf32",
        "fused_attention",
        "compile",
        "micro_batch",
        "compression",
        "channels_last",
        "float8",
    ),  # fmt: skip
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
    # FP8 matmuls on top of bf16 + compile: torchtitan's Llama-3-8B 1.28x, torchao's +10-25 % (the large matmuls
    # only); no FP8 on a CPU
    "float8": {"forward": 0.2, "backward": 0.2, "cpu": {"forward": 0.0, "backward": 0.0}},
    # the passes over the logits that are not written and read back (memory-bound on a GPU); on a CPU the chunked
    # loss measured 0.99-1.40x the plain head's time (benchmarks/bench_linear_cross_entropy.py): it saves memory there
    "fused_cross_entropy": {"forward": 0.05, "backward": 0.05, "cpu": {"forward": 0.0, "backward": 0.0}},
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

#: Fixes that stack on others go after every other fix, whatever their priors: FP8 is tried on top of bf16 and
#: compile, and a fix is asked once (reached before them, it would be refused for good).
STACKED_LAST: tuple[str, ...] = ("float8",)


def fix_gains(findings: Iterable[Finding]) -> dict[str, float]:
    """What the compute attribution says each fix would save (a share of the step): every compute finding's
    ``saving`` credited to the first fix :data:`RULE_FIXES` names for its rule, summed per fix (``compile`` fuses
    the chains and the loop alike), at most 0.95."""
    gains: dict[str, float] = {}
    for f in findings:
        fixes = RULE_FIXES.get(f.rule, ())
        if f.kind != "compute" or f.saving is None or not fixes:
            continue
        gains[fixes[0]] = min(0.95, gains.get(fixes[0], 0.0) + float(f.saving))
    return gains


def rank_by_expected_gain(
    names: Sequence[str],
    shares: Mapping[str, float],
    device_type: str | None = None,
    measured: Mapping[str, float] | None = None,
) -> list[str]:
    """``names`` by decreasing expected gain, :data:`SHAPE_FIRST` ahead and :data:`STACKED_LAST` behind; fixes without a prior keep their place
    after those with one; ties keep the given order (the doctor's findings first). ``measured``: gains the compute
    attribution found (:func:`fix_gains`), which replace those fixes' priors."""
    measured = measured or {}

    def gain(n: str) -> float | None:
        return measured[n] if n in measured else expected_gain(n, shares, device_type)

    order = {n: i for i, n in enumerate(names)}
    known = [n for n in names if gain(n) is not None]
    unknown = [n for n in names if n not in known]
    known.sort(key=lambda n: (n not in SHAPE_FIRST, n in STACKED_LAST, -round(gain(n) or 0.0, 4), order[n]))
    return known + unknown


def attribution_share(shares: Mapping[str, float]) -> float | None:
    """The compute share (forward + backward) that calls for one profiled window of the doctor's compute attribution,
    when it reaches the doctor's compute threshold; ``None`` below it (the priors alone order the fixes)."""
    from lightning_accel.core.rules import Thresholds

    compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
    return min(1.0, compute) if compute >= Thresholds().compute_share else None


#: One proposed fix: its name, the share of the step it is expected to remove (``None``: a fix of the user's own,
#: without a prior) and the share of that gain a pay-back decision counts (:func:`prior_confidence`).
Proposal = tuple[str, "float | None", float]


def proposal(
    shares: Mapping[str, float],
    context: RunContext,
    *,
    builtin: Sequence[str],
    extras: Sequence[str],
    tried: Set[str],
    device_type: str,
    threshold: float,
    accumulate: int,
    smells: Sequence[str] = (),
    compute: Sequence[Finding] = (),
) -> list[Proposal]:
    """The fixes to try next, most promising first: those the doctor's rules name for ``shares`` and ``context`` (a
    :class:`~lightning_accel.core.findings.RunContext`), a larger micro-batch where ``accumulate > 1``, the code
    ``smells``' fixes and the ``compute`` findings' (first), then the stages' (:func:`propose`), ranked by expected
    gain (:func:`rank_by_expected_gain`, the compute attribution's savings replacing those fixes' priors), then the
    user's own ``extras`` in their order. ``builtin``: the built-in fixes allowed (their order breaks ties)."""
    from lightning_accel.core.rules import diagnose, holding_back

    shares = dict(shares)
    diagnosis = diagnose(shares, context)
    bottleneck = holding_back(shares, diagnosis.findings)
    rules = [f.rule for f in compute] + [f.rule for f in diagnosis.findings]
    rules += ["accumulation"] * (accumulate > 1)
    rules += list(smells)
    device = prior_device(device_type)  # "cpu+bf16": a CPU with bf16 in hardware
    measured = fix_gains(compute)
    names = propose(rules, bottleneck, builtin, tried, shares, threshold)
    names = rank_by_expected_gain(names, shares, device, measured)
    names += [n for n in extras if n not in tried and n not in names]
    return [
        (
            n,
            (measured.get(n) or expected_gain(n, shares, device)) if n in builtin else None,
            prior_confidence(n, device),
        )
        for n in names
    ]
