"""The Autopilot's decisions, framework-free: nothing here runs a step or imports Lightning.

One module per concern, each used by the ones after it:

- :mod:`~.numerics`: the numerics guard (tolerances per kind, probes compared);
- :mod:`~.plan`: the trial rows and their outcomes, the replayable plan and its rendering (YAML, Python, the claim);
- :mod:`~.protocol`: the candidate, the backend the loop drives, the windows and offers it returns;
- :mod:`~.pairing`: the paired windows (A B, A B B A, A B B A B) and the keep rule;
- :mod:`~.priors`: which fix each finding and stage names, what each can remove, the proposal;
- :mod:`~.budget`: what a search, a trial and a window cost and whether a fix repays them, the window length;
- :mod:`~.trials` and :mod:`~.search`: the trials and the loop around them.

:class:`~lightning_accel.Autopilot` (``callbacks/autopilot/``) measures and applies; these decide, so every decision
is unit-tested with exact numbers (sources of the guards: ``docs/method.md``, "Closing the loop automatically").
"""

from lightning_accel.core.autopilot.budget import (
    ESTIMATE_WINDOW,
    MIN_WINDOW_SECONDS,
    SHORT_WARMUP_STEPS,
    WindowLength,
    compile_pays_back,
    window_steps,
)
from lightning_accel.core.autopilot.numerics import (
    DEFAULT_TOLERANCES,
    NUMERICS_KINDS,
    NumericsCheck,
    ProbeResult,
    Tolerance,
    batch_digest,
    compare_probes,
    cosine,
)
from lightning_accel.core.autopilot.pairing import (
    DECISIVE_GAIN,
    NOISE_CAP,
    Pairs,
    claimed_speedup,
    decide_paired,
    measure_pairs,
    needs_third_pair,
    noise_gate,
    paired_bar,
    relative_noise,
)
from lightning_accel.core.autopilot.plan import (
    PLAN_VERSION,
    AutopilotPlan,
    Outcome,
    TrialRecord,
    claim_text,
    model_fingerprint,
    plan_misfit,
    render_python,
    render_yaml,
)
from lightning_accel.core.autopilot.priors import (
    EXPECTED_REMOVAL,
    PRIOR_CONFIDENCE,
    RULE_FIXES,
    SHAPE_FIRST,
    STAGE_FIXES,
    expected_gain,
    fix_gains,
    prior_confidence,
    prior_device,
    proposal,
    propose,
    rank_by_expected_gain,
)
from lightning_accel.core.autopilot.protocol import (
    Bundle,
    Candidate,
    Measurement,
    MeasurementLike,
    Offer,
    SearchBackend,
    SearchProgress,
    SearchResult,
    SearchStatus,
    Undo,
)
from lightning_accel.core.autopilot.search import FINAL_PAIRS, AutopilotSearch

__all__ = [
    "DECISIVE_GAIN",
    "DEFAULT_TOLERANCES",
    "ESTIMATE_WINDOW",
    "EXPECTED_REMOVAL",
    "FINAL_PAIRS",
    "MIN_WINDOW_SECONDS",
    "NOISE_CAP",
    "NUMERICS_KINDS",
    "PLAN_VERSION",
    "PRIOR_CONFIDENCE",
    "RULE_FIXES",
    "SHAPE_FIRST",
    "SHORT_WARMUP_STEPS",
    "STAGE_FIXES",
    "AutopilotPlan",
    "AutopilotSearch",
    "Bundle",
    "Candidate",
    "Measurement",
    "MeasurementLike",
    "NumericsCheck",
    "Offer",
    "Outcome",
    "Pairs",
    "ProbeResult",
    "SearchBackend",
    "SearchProgress",
    "SearchResult",
    "SearchStatus",
    "Tolerance",
    "TrialRecord",
    "Undo",
    "WindowLength",
    "batch_digest",
    "claim_text",
    "claimed_speedup",
    "compare_probes",
    "compile_pays_back",
    "cosine",
    "decide_paired",
    "expected_gain",
    "fix_gains",
    "measure_pairs",
    "model_fingerprint",
    "needs_third_pair",
    "noise_gate",
    "paired_bar",
    "plan_misfit",
    "prior_confidence",
    "prior_device",
    "propose",
    "proposal",
    "rank_by_expected_gain",
    "relative_noise",
    "render_python",
    "render_yaml",
    "window_steps",
]
