"""The numerics guard: whether a change computes what the configuration before it computed, within the tolerance of
its kind, on fixed probe batches at the same weights (loss, gradient direction, optimizer update; bit-identical batches
for a data-loading change)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_accel.core.batch import iter_tensors

__all__ = [
    "DEFAULT_TOLERANCES",
    "NUMERICS_KINDS",
    "NumericsCheck",
    "ProbeResult",
    "Tolerance",
    "batch_digest",
    "compare_probes",
    "cosine",
]

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
    """The numerics guard's verdict on one change, with the numbers.

    ``changed_nothing``: why a change whose numbers passed turned out to change nothing once its probe ran (it is then
    rejected without being measured), else ``None``; the backend asks each change after the probe."""

    ok: bool
    kind: str
    reason: str
    loss_rel_diff: float | None = None
    grad_cosine: float | None = None
    update_cosine: float | None = None
    changed_nothing: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["changed_nothing"] is None:
            del out["changed_nothing"]
        return out


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
