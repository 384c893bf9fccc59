"""The Autopilot's plan: one row per trial (:class:`TrialRecord`, its :class:`Outcome`), the kept changes and the
measurements that justified them (:class:`AutopilotPlan`, replayable by ``Autopilot(plan=path)``), and their rendering:
a LightningCLI YAML fragment, a Python snippet, the claimed speed-up in words."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from lightning_accel._atomic import atomic_open

__all__ = [
    "PLAN_VERSION",
    "AutopilotPlan",
    "Outcome",
    "TrialRecord",
    "claim_text",
    "model_fingerprint",
    "plan_misfit",
    "render_python",
    "render_yaml",
]

PLAN_VERSION = 1


class Outcome(str, Enum):
    """How a trial ended (a string in the plan's JSON)."""

    BASELINE = "baseline"
    #: the fix cannot apply to this run (or is frozen)
    NOT_APPLICABLE = "not applicable"
    #: the fix could apply but was not tried: it would not pay back, or the budget was spent
    NOT_TRIALLED = "not trialled"
    #: applying it raised (on any rank); nothing is left applied
    COULD_NOT_APPLY = "could not apply"
    #: refused before being measured: the numerics guard, a change that changed nothing, a bundle not formed
    REJECTED = "rejected"
    #: measured and decided (``kept`` says how)
    MEASURED = "measured"
    #: an error during the trial (the change is reverted)
    FAILED = "failed"
    #: applied from a plan without searching, or not (``kept`` says which)
    REPLAYED = "replayed"

    @property
    def trialled(self) -> bool:
        """Whether it counts as a trial (``autopilot/trials``) when it measured nothing."""
        return self in (Outcome.COULD_NOT_APPLY, Outcome.FAILED)

    @property
    def logged(self) -> bool:
        """Whether its row is logged (``autopilot/trial_*``): a fix never tried has nothing to log."""
        return self not in (Outcome.BASELINE, Outcome.NOT_APPLICABLE, Outcome.NOT_TRIALLED)


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
    outcome: Outcome = Outcome.MEASURED

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (the outcome as its string): the plan goes into JSON files and checkpoints, which
        ``torch.load(weights_only=True)`` reads without our classes."""
        out = asdict(self)
        out["outcome"] = Outcome(self.outcome).value
        return out


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
    #: what the plan was measured on, checked before it is replayed (:func:`plan_misfit`); absent in older plans
    fingerprint: str | None = None
    device: str | None = None
    global_batch: int | None = None
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


def model_fingerprint(module: torch.nn.Module) -> str:
    """A short digest of the model's parameter names, shapes and dtypes: the same architecture at the same size
    gives the same digest whatever its weights (a compiled wrapper's ``_orig_mod.`` prefix is left out)."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(f"{name.replace('_orig_mod.', '')}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:16]


def plan_misfit(
    plan: AutopilotPlan, *, fingerprint: str, device: str, world_size: int, global_batch: int | None
) -> str | None:
    """Why ``plan`` was not made for this run (one line naming each difference), or ``None``. A fix measured on
    another model, device or global batch carries neither its speed nor its numerics check over; what an older plan
    does not record is not compared."""
    differences = []
    if plan.fingerprint is not None and plan.fingerprint != fingerprint:
        differences.append(
            f"the model (the plan's {plan.model or '?'} has parameter fingerprint {plan.fingerprint}, this run's "
            f"{fingerprint}: other layers or sizes)"
        )
    if plan.device is not None and plan.device != device:
        differences.append(f"the device type (plan: {plan.device}, this run: {device})")
    if plan.world_size != world_size:
        differences.append(f"the number of devices (plan: {plan.world_size}, this run: {world_size})")
    if plan.global_batch is not None and global_batch is not None and plan.global_batch != global_batch:
        differences.append(
            f"the global batch (plan: {plan.global_batch} samples per optimizer step, this run: {global_batch})"
        )
    return "; ".join(differences) or None


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


def claim_text(plan: AutopilotPlan) -> str:
    """The claimed speed-up as the summary line says it, with how it was measured (empty without a claim)."""
    if plan.speedup is None:
        return ""
    if plan.speedup_source == "trials":
        return f", {plan.speedup:.2f}x the untouched configuration (product of the kept trials' paired ratios)"
    interval = (
        f", 90 % interval {plan.speedup_low:.2f}-{plan.speedup_high:.2f}"
        if plan.speedup_low is not None and plan.speedup_high is not None
        else ""
    )
    return f", {plan.speedup:.2f}x the untouched configuration (final paired A/B{interval})"
