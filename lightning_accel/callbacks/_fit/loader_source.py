"""Where the train DataLoader of a fit comes from, and how to get it rebuilt with other settings.

Either ``train_dataloader()`` reads attributes that can be set, or the loader is re-created from its own
constructor arguments. Every tuner goes through :class:`TrainLoaderSource`: the Autopilot,
:class:`~lightning_accel.DataLoaderTuner` and :class:`~lightning_accel.BatchSizeTuner`. See
docs/techniques/data-loading.md (Where the loader comes from).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LOADER_KEYS", "TrainLoaderSource", "fit_data_holder", "rebuild_dataloader"]

#: DataLoader arguments a tuner may change (also the attribute names looked for, unless the caller names others).
LOADER_KEYS: tuple[str, ...] = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "batch_size")


def _sanitise(values: Mapping[str, Any]) -> dict[str, Any]:
    """DataLoader refuses ``prefetch_factor`` and ``persistent_workers=True`` with ``num_workers=0``."""
    out = dict(values)
    if out.get("num_workers") == 0:
        out["prefetch_factor"] = None
        out["persistent_workers"] = False
    return out


class TrainLoaderSource:
    """The fit's train DataLoader: read its settings, build it with others, make the fit use them.

    Private Lightning names (through :mod:`lightning_accel._compat`): the fit loop's data source (where the fit
    records what feeds it; ``.instance`` is the module or the loader), and the re-instantiation Lightning uses for
    sampler injection.

    Args:
        trainer: the fitting Trainer (its fit loop knows where the train data comes from).
        pl_module: the LightningModule (attributes are looked up through it, like Lightning's ``batch_size``).
        attribute_names: per key of :data:`LOADER_KEYS`, the attribute ``train_dataloader()`` reads, where it is not
            the key itself (``{"batch_size": "bs"}``).
        require_dataloader: refuse a ``train_dataloader()`` that returns a collection of loaders or a DALI
            pipeline. ``False`` for a caller that changes attributes only (whatever ``train_dataloader()`` builds
            from them follows: ``BatchSizeTuner`` re-sizes a DALI pipeline through its ``batch_size``); a
            collection passed straight to ``fit()`` is always refused (it cannot be rebuilt).

    Raises ``ValueError`` when the train data is not a single ``DataLoader`` (a DALI pipeline, a collection of
    loaders); the message says why.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        *,
        attribute_names: Mapping[str, str] | None = None,
        require_dataloader: bool = True,
    ) -> None:
        from lightning.pytorch.utilities.parsing import lightning_hasattr

        from lightning_accel._compat import fit_loop_data_source

        self.trainer, self.module = trainer, pl_module
        unknown = sorted(set(attribute_names or {}) - set(LOADER_KEYS))
        if unknown:
            raise ValueError(f"TrainLoaderSource(attribute_names=...): unknown keys {unknown}; known: {LOADER_KEYS}")
        #: per key, the attribute of the module / datamodule that holds it
        self.names = {key: (attribute_names or {}).get(key, key) for key in LOADER_KEYS}
        source = fit_loop_data_source(trainer)
        self._source = source
        self._original_instance = source.instance
        self.holder = source.instance if source.is_module() else None
        if (
            require_dataloader
            and self.holder is not None
            and isinstance(getattr(self.holder, "pipeline_settings", None), Mapping)
        ):
            raise ValueError(
                f"the train data comes from {type(self.holder).__name__} (a DALI pipeline), not a DataLoader"
            )
        self._original = self._fresh()
        if not isinstance(self._original, DataLoader) and (require_dataloader or self.holder is None):
            raise ValueError(f"the train data is a {type(self._original).__name__}, not one torch DataLoader")
        #: per key, whether it is set through an attribute (else the loader is rebuilt with it)
        self.attributes = (
            {k: lightning_hasattr(pl_module, self.names[k]) for k in LOADER_KEYS}
            if self.holder is not None
            else dict.fromkeys(LOADER_KEYS, False)
        )
        self.initial = self.settings_of(self._original)
        self._overrides: dict[str, Any] = {}

    # ------------------------------------------------------------------ reading
    @staticmethod
    def settings_of(loader: Any) -> dict[str, Any]:
        """The :data:`LOADER_KEYS` settings of ``loader`` (the batch sampler's batch size when it has one)."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        return {
            "num_workers": int(getattr(loader, "num_workers", 0) or 0),
            "prefetch_factor": getattr(loader, "prefetch_factor", None) if getattr(loader, "num_workers", 0) else None,
            "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "batch_size": getattr(loader, "batch_size", None) or getattr(batch_sampler, "batch_size", None),
        }

    def batches(self) -> int:
        """Batches per epoch of the user's loader as configured (``TypeError`` for an unsized one)."""
        return len(self._original)

    def current(self) -> dict[str, Any]:
        """The settings the fit would use now: the loader's own, with the overrides set so far."""
        return {**self.initial, **self._overrides}

    def can_set(self, key: str) -> str | None:
        """``None`` when ``key`` can be changed, else the reason it cannot."""
        if key == "batch_size" and not self.attributes["batch_size"]:
            sampler = getattr(self._original, "batch_sampler", None)
            from torch.utils.data import BatchSampler

            if self._original.batch_size is None and type(sampler) is not BatchSampler:
                return (
                    f"the loader batches with a custom {type(sampler).__name__}, whose batch size cannot be "
                    "changed from outside"
                )
        if self.holder is not None and not self.attributes[key] and self.trainer.reload_dataloaders_every_n_epochs:
            return (
                f"`train_dataloader()` reads no `{key}` attribute and is re-called every "
                f"{self.trainer.reload_dataloaders_every_n_epochs} epoch(s) (reload_dataloaders_every_n_epochs): "
                f"add `self.{key}` and build the DataLoader from it"
            )
        return None

    # ------------------------------------------------------------------ building
    def _fresh(self) -> Any:
        """The loader as the user's code builds it now (``train_dataloader()``, or the object given to fit)."""
        if self.holder is not None:
            return self.holder.train_dataloader()
        return self._original_instance

    def build(self, overrides: Mapping[str, Any] | None = None) -> DataLoader:
        """A new DataLoader with the current settings plus ``overrides`` (the fit's own loader is not touched)."""
        requested = {**self._overrides, **(overrides or {})}
        values = _sanitise(requested)
        previous = self._set_attributes(values)
        try:
            base = self._fresh()
            rebuild = self._to_rebuild(values, requested, base)
            if self.holder is not None and not rebuild:
                return base
            return rebuild_dataloader(base, rebuild)
        finally:
            self._restore_attributes(previous)

    def _to_rebuild(self, values: Mapping[str, Any], requested: Mapping[str, Any], base: Any) -> dict[str, Any]:
        """The values no attribute carries: those asked for, and those :func:`_sanitise` added where ``base``
        differs (``num_workers=0`` set through an attribute needs no rebuild of a loader already without prefetch)."""
        own = self.settings_of(base)
        return {k: v for k, v in values.items() if not self.attributes[k] and (k in requested or own.get(k) != v)}

    def _set_attributes(self, values: Mapping[str, Any]) -> dict[str, Any]:
        from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

        previous = {}
        for key, value in values.items():
            if self.attributes[key]:
                previous[key] = lightning_getattr(self.module, self.names[key])
                lightning_setattr(self.module, self.names[key], value)
        return previous

    def _restore_attributes(self, previous: Mapping[str, Any]) -> None:
        from lightning.pytorch.utilities.parsing import lightning_setattr

        for key, value in previous.items():
            lightning_setattr(self.module, self.names[key], value)

    # ------------------------------------------------------------------ what the fit uses
    def set(self, overrides: Mapping[str, Any]) -> None:
        """Make ``overrides`` part of the current settings (for later builds and for :meth:`install`)."""
        for key in overrides:
            if key not in LOADER_KEYS:
                raise ValueError(f"unknown DataLoader setting {key!r}; known: {list(LOADER_KEYS)}")
        self._overrides = _sanitise({**self._overrides, **overrides})
        # a value equal to the user's own is no change at all
        self._overrides = {k: v for k, v in self._overrides.items() if self.initial.get(k) != v}

    def install(self) -> None:
        """Make the fit loop build its train loader with the current settings: attributes are set on the
        module/datamodule (the fit loop calls ``train_dataloader()`` after ``on_fit_start``); otherwise the rebuilt
        loader replaces the fit's data source."""
        values = _sanitise(self._overrides)
        self._source.instance = self._original_instance
        self._set_attributes(values)
        if any(not self.attributes[k] for k in values):
            base = self._fresh()
            rebuild = self._to_rebuild(values, self._overrides, base)
            if rebuild:
                self._source.instance = rebuild_dataloader(base, rebuild)

    # ------------------------------------------------------------------ telling the user
    def config_entries(self) -> tuple[list[tuple[str, Any]], list[str]]:
        """The current overrides as LightningCLI keys (attributes) and Python lines."""
        yaml: list[tuple[str, Any]] = []
        python: list[str] = []
        values = self._overrides
        if not values:
            return yaml, python
        owner = "data" if self.holder is not None and self.holder is not self.module else "model"
        attr = {k: v for k, v in values.items() if self.attributes[k]}
        rebuilt = {k: v for k, v in values.items() if not self.attributes[k]}
        for key, value in attr.items():
            yaml.append((f"{owner}.{self.names[key]}", value))
            python.append(f"{'datamodule' if owner == 'data' else 'model'}.{self.names[key]} = {value!r}")
        if rebuilt:
            args = ", ".join(f"{k}={v!r}" for k, v in rebuilt.items())
            if self.holder is None:
                python.append(f"train_loader = DataLoader(..., {args})  # the DataLoader given to trainer.fit")
            else:  # no attribute to set: the DataLoader that train_dataloader() builds
                python.append(f"# in {type(self.holder).__name__}.train_dataloader(): DataLoader(..., {args})")
        return yaml, python


def fit_data_holder(trainer: pl.Trainer) -> Any:
    """The datamodule or LightningModule whose ``train_dataloader()`` feeds this fit; ``None`` when the train data
    was passed straight to ``trainer.fit(model, loader)`` (then :class:`TrainLoaderSource` rebuilds it)."""
    from lightning_accel._compat import fit_loop_data_source

    source = fit_loop_data_source(trainer)
    return source.instance if source.is_module() else None


def rebuild_dataloader(loader: DataLoader, overrides: Mapping[str, Any]) -> DataLoader:
    """``loader`` re-created from its constructor arguments with ``overrides`` (same dataset, sampler, collate_fn,
    generator, ...), through Lightning's sampler-injection machinery. A custom batch sampler keeps its batch size.

    Raises:
        ValueError: the loader cannot be re-created (Lightning's reason included).
    """
    if not overrides:
        return loader
    from lightning_accel._compat import dataloader_init_arguments, reinstantiate_dataloader

    try:
        args, kwargs = dataloader_init_arguments(loader)
    except Exception as err:  # MisconfigurationException / TypeError with Lightning's explanation
        raise ValueError(
            f"cannot rebuild the train DataLoader ({type(loader).__name__}) with {dict(overrides)}: {err}"
        ) from err
    names = getattr(loader, "__pl_saved_arg_names", ())
    if args and names:  # positional arguments saved by Lightning's hook wrapper: name them so overrides win
        kwargs = {**dict(zip(names, args)), **kwargs}
        args = args[len(names) :]
    kwargs = dict(kwargs)
    values = _sanitise({**TrainLoaderSource.settings_of(loader), **overrides})
    for key, value in values.items():
        if key == "batch_size" and kwargs.get("batch_sampler") is not None:
            continue  # a custom batch sampler owns the batch size (TrainLoaderSource.can_set refuses it)
        if key == "prefetch_factor" and value is None and not values.get("num_workers"):
            kwargs.pop(key, None)
            continue
        kwargs[key] = value
    try:
        return reinstantiate_dataloader(loader, *args, **kwargs)
    except Exception as err:
        raise ValueError(
            f"cannot rebuild the train DataLoader ({type(loader).__name__}) with "
            f"{dict(overrides)}: {type(err).__name__}: {err}"
        ) from err


#: the settings of the train loader that also suit validation: how batches are produced, never what they hold
VALIDATION_KEYS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")


def apply_to_validation_loader(trainer: Any, values: Mapping[str, Any], check_batches: int = 2) -> str:
    """Give the fit's validation DataLoader the loader settings kept for the train loader (workers, prefetch,
    persistent workers, pinned memory: never its batch size, and never how often validation runs), when it is one
    torch DataLoader and the rebuilt loader delivers bit-identical first ``check_batches`` batches.

    Returns one line for the Autopilot's notes: what changed, or why nothing did.
    """
    from lightning_accel._compat import val_loop_data_source
    from lightning_accel.core.autopilot import batch_digest

    values = {k: v for k, v in values.items() if k in VALIDATION_KEYS}
    if not values:
        return "validation DataLoader: no loader setting to share"
    if trainer.limit_val_batches == 0 or not trainer.enable_validation:
        return "validation DataLoader: validation is off"
    source = val_loop_data_source(trainer)
    if not source.is_defined():
        return "validation DataLoader: none"
    if source.is_module() and trainer.reload_dataloaders_every_n_epochs:
        return (
            "validation DataLoader left as built: `val_dataloader()` is re-called every "
            f"{trainer.reload_dataloaders_every_n_epochs} epoch(s); build it from the same attributes"
        )
    loader = source.dataloader()
    if not isinstance(loader, DataLoader):
        return f"validation DataLoader left alone: it is a {type(loader).__name__}, not one torch DataLoader"
    current = TrainLoaderSource.settings_of(loader)
    wanted = {k: v for k, v in _sanitise({**current, **values}).items() if k in values and current.get(k) != v}
    if not wanted:
        return "validation DataLoader: already uses the kept settings"
    try:
        rebuilt = rebuild_dataloader(loader, wanted)
    except ValueError as err:
        return f"validation DataLoader left alone: {err}"

    def digests(dl: DataLoader) -> list[str]:
        out = []
        for i, batch in enumerate(dl):
            if i >= check_batches:
                break
            out.append(batch_digest(batch))
        return out

    try:
        same = digests(loader) == digests(rebuilt)
    except Exception as err:  # noqa: BLE001 - a loader that cannot be read twice stays as it is
        return f"validation DataLoader left alone: reading it raised {type(err).__name__}: {err}"
    if not same:
        return (
            "validation DataLoader left alone: with the train loader's settings it delivered different batches "
            "(e.g. augmentation seeded per worker)"
        )
    source.instance = rebuilt
    shown = ", ".join(f"{k}={v!r}" for k, v in wanted.items())
    return f"validation DataLoader: {shown} (as the train loader; same batches, validation as often as before)"
