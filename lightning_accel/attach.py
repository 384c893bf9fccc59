"""Attach the collection to a Lightning script without editing it: the ``LIGHTNING_ACCEL`` environment variable, read
by the callbacks factory Lightning calls on every ``Trainer(...)``, and by ``lightning-accel run`` (docs/attach.md).

Nothing else in the package knows this module exists: it builds the public callbacks with their public arguments.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ENV_VAR", "FORMS", "RECORD_VAR", "AttachSpec", "callbacks_factory", "parse_spec"]

#: the opt-in variable: unset or empty, the factory returns nothing
ENV_VAR = "LIGHTNING_ACCEL"
#: set by ``lightning-accel run``: the file where rank 0 lists the reports it wrote, one JSON line per fit
RECORD_VAR = "LIGHTNING_ACCEL_RUN_RECORD"
#: the accepted forms, as a malformed value's warning names them
FORMS = (
    "a comma-separated list of doctor, mfu, html (the doctor's HTML page), autopilot, plan:PATH (replay a plan), "
    "dir:PATH (the report folder), e.g. LIGHTNING_ACCEL=doctor,mfu or LIGHTNING_ACCEL=plan:autopilot_plan.json"
)
#: the report folder when neither ``dir:`` nor a logger names one, under the Trainer's ``default_root_dir``
DEFAULT_FOLDER = "lightning_accel"

_WORDS = ("doctor", "mfu", "html", "autopilot")
_KEYS = ("plan", "dir")


@dataclass(frozen=True)
class AttachSpec:
    """What ``LIGHTNING_ACCEL`` asks for."""

    doctor: bool = False
    mfu: bool = False
    html: bool = False
    autopilot: bool = False
    plan: Path | None = None
    report_dir: Path | None = None

    def to_value(self) -> str:
        """The variable's value that parses back to this spec (``lightning-accel run`` sets it)."""
        items = [word for word in _WORDS if getattr(self, word)]
        if self.plan is not None:
            items.append(f"plan:{self.plan}")
        if self.report_dir is not None:
            items.append(f"dir:{self.report_dir}")
        return ",".join(items)


def parse_spec(value: str) -> AttachSpec:
    """``LIGHTNING_ACCEL``'s value as a spec; ``ValueError`` naming the value and :data:`FORMS` when malformed."""
    flags: dict[str, bool] = {}
    paths: dict[str, Path] = {}
    for raw in value.split(","):
        item = raw.strip()
        key, sep, rest = item.partition(":")
        if sep and key.strip().lower() in _KEYS:
            key = key.strip().lower()
            if not rest.strip():
                raise ValueError(f"{ENV_VAR}={value!r}: {key}: needs a path after the colon; accepted: {FORMS}")
            paths[key] = Path(rest.strip()).expanduser()
        elif not sep and item.lower() in _WORDS:
            flags[item.lower()] = True
        else:
            raise ValueError(f"{ENV_VAR}={value!r}: {item!r} is not understood; accepted: {FORMS}")
    if flags.get("autopilot") and "plan" in paths:
        raise ValueError(f"{ENV_VAR}={value!r}: autopilot searches and plan:PATH replays a plan; give one of them")
    if flags.get("html"):
        flags["doctor"] = True  # the page is the doctor's report
    return AttachSpec(**flags, plan=paths.get("plan"), report_dir=paths.get("dir"))


def _spec_from_environment(environ: Mapping[str, str]) -> AttachSpec | None:
    value = environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    try:
        return parse_spec(value)
    except ValueError as err:
        _warn_once(f"lightning-accel: {err}. The job trains without lightning-accel attached.")
        return None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def callbacks_factory(namespace: str = "lightning.pytorch", environ: Mapping[str, str] | None = None) -> list[Any]:
    """The callbacks ``LIGHTNING_ACCEL`` asks for, for the ``Trainer`` being built: none when it is unset or
    malformed (a warning, once per process), none of a type the user passed already (theirs wins, with their
    arguments). ``MFUMonitor`` and ``BottleneckDoctor`` attached this way switch themselves off with one warning
    when a hook of theirs raises, so a diagnostics failure never stops the fit; the Autopilot, which changes the
    training, is not guarded."""
    spec = _spec_from_environment(os.environ if environ is None else environ)
    if spec is None:
        return []
    from lightning_accel._compat import callbacks_being_configured

    theirs = callbacks_being_configured()
    taken = {type(c) for c in theirs} if theirs is not None else set()
    run = AttachedRun(spec)
    _guard(run)
    for callback in _build(spec):
        if type(callback) in taken:
            continue
        if not getattr(callback, "_lightning_accel_changes_training", False):
            _guard(callback)
        run.attached.append(callback)
    if not run.attached:
        return []
    return [run, *run.attached]


def _build(spec: AttachSpec) -> list[Any]:
    import lightning_accel as la

    out: list[Any] = []
    if spec.mfu:
        out.append(la.MFUMonitor())
    if spec.doctor:
        out.append(la.BottleneckDoctor())
    if spec.autopilot or spec.plan is not None:
        autopilot = la.Autopilot(plan=spec.plan)
        autopilot._lightning_accel_changes_training = True  # type: ignore[attr-defined]
        out.append(autopilot)
    return out


class AttachedRun(Callback):
    """The attached callbacks' run folder and record: at ``setup`` it points their files into one folder (``dir:``,
    else the logger's ``log_dir``, else ``<default_root_dir>/lightning_accel``); when the fit ends, rank 0 appends
    the files written to the record ``lightning-accel run`` reads. Holds no state of the fit."""

    def __init__(self, spec: AttachSpec) -> None:
        self.spec = spec
        self.attached: list[Any] = []
        self.folder: Path | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_accel.callbacks.autopilot import Autopilot
        from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor
        from lightning_accel.callbacks.doctor.report import report_dir

        if self.spec.report_dir is not None:
            folder = self.spec.report_dir
        elif trainer.loggers:
            folder = report_dir(trainer)
        else:
            folder = Path(trainer.default_root_dir) / DEFAULT_FOLDER
        self.folder = folder
        theirs = {type(c) for c in trainer.callbacks if c is not self and c not in self.attached}
        for callback in self.attached:
            if type(callback) in theirs:  # added to the Trainer after it was built: theirs wins
                _switch_off(callback)
            elif isinstance(callback, BottleneckDoctor) and callback.report_path is None:
                callback.report_path = folder / (
                    "bottleneck_report.html" if self.spec.html else "bottleneck_report.json"
                )
            elif isinstance(callback, Autopilot) and callback.save_plan is None:
                callback.save_plan = folder / "autopilot_plan.json"

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        record = os.environ.get(RECORD_VAR)
        if not record:
            return
        files = [str(f) for f in self.written(trainer)]
        try:
            with open(record, "a") as fh:
                fh.write(json.dumps({"folder": str(self.folder), "files": files}) + "\n")
        except OSError as err:  # the record only tells `run` what to print
            _warn_once(f"lightning-accel run: could not write its record {record} ({err})")

    def written(self, trainer: pl.Trainer) -> list[Path]:
        """The files our callbacks on ``trainer`` wrote, the user's own included: the doctor's report, page, plot
        and window log, the Autopilot's plan."""
        out: list[Path] = []
        for callback in trainer.callbacks:
            if not type(callback).__module__.startswith("lightning_accel."):
                continue
            written = getattr(callback, "files", None)
            if isinstance(written, list):
                out.extend(Path(f) for f in written)
            window_log = getattr(callback, "window_log_path", None)
            if window_log is not None:
                out.append(Path(window_log))
            plan_path = getattr(callback, "_plan_path", None)
            if callable(plan_path):
                out.extend(p for p in [plan_path(trainer)] if p is not None)
        return [f for f in dict.fromkeys(out) if f.exists()]


def _hook_names() -> Sequence[str]:
    return [
        name
        for name, value in vars(Callback).items()
        if callable(value) and (name.startswith("on_") or name in ("setup", "teardown"))
    ]


#: hooks a switched-off callback still runs (errors ignored): they remove what it installed on the Trainer
_CLEANUP_HOOKS = ("teardown", "on_exception")


def _guard(callback: Callback) -> None:
    """Wrap each hook ``callback``'s class overrides: the first exception warns once, naming the callback, the hook
    and the error, and switches the callback off for the rest of the process; the fit goes on."""
    cls = type(callback)
    callback._lightning_accel_guarded = True  # type: ignore[attr-defined]
    for name in _hook_names():
        if getattr(cls, name, None) is getattr(Callback, name, None):
            continue
        setattr(callback, name, _guarded(callback, name, getattr(callback, name)))


def _guarded(callback: Any, name: str, hook: Any) -> Any:
    @functools.wraps(hook)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(callback, "_lightning_accel_off", False):
            if name in _CLEANUP_HOOKS:
                try:
                    return hook(*args, **kwargs)
                except Exception:  # noqa: BLE001 - already switched off and warned
                    return None
            return None
        try:
            return hook(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - an attached measurement must not stop the user's fit
            _switch_off(callback)
            warnings.warn(
                f"lightning-accel: the attached {type(callback).__name__} failed in {name} "
                f"({type(err).__name__}: {err}); it is switched off and the fit goes on without it",
                stacklevel=2,
            )
            return None

    return call


def _switch_off(callback: Any) -> None:
    if not getattr(callback, "_lightning_accel_guarded", False):
        _guard(callback)
    callback._lightning_accel_off = True
