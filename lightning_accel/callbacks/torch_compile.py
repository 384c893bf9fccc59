"""TorchCompile: ``torch.compile`` the LightningModule's model in place at setup, with a graceful eager fallback."""

from __future__ import annotations

import fnmatch
import time
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel._checks import check_int
from lightning_accel.core.checkpointing import CHECKPOINT_PREFIX, clean_module_name
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

_compat.require_versions("TorchCompile")

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TorchCompile"]

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class TorchCompile(Callback):
    """Compiles the LightningModule's model (or chosen submodules) with ``torch.compile`` when ``fit`` sets up.

    Each target is compiled **in place** (like ``nn.Module.compile()``: the module's call goes through
    the compiled function, the module object stays where it was), so parameter names, ``state_dict`` keys and
    checkpoints are exactly those of the eager model — no ``_orig_mod.`` prefixes — and optimizers, DDP and other
    callbacks see the same module tree.

    Targets: ``modules=None`` compiles every direct child of the LightningModule that has parameters (e.g.
    ``self.model``; the LightningModule's own ``training_step`` logic stays eager); otherwise ``modules`` lists
    ``fnmatch`` patterns over qualified module names (``"model"``, ``"model.blocks.*"``) or module types.
    A pattern that matches nothing raises ``ValueError`` listing the names present.

    Compilation is lazy: it happens on the first call (forward, and backward through AOTAutograd), and may happen again
    when shapes change. A call made while a ``TorchDispatchMode`` is active — ``MFUMonitor`` counting FLOPs with
    ``FlopCounterMode`` on the first batch — runs eagerly (dynamo would otherwise stop compiling that code for the rest
    of the run), so compilation then happens on the second batch. ``warmup_batches`` tells ``MFUMonitor`` (and
    ``BottleneckDoctor``) how many batches to leave out of their measurements.

    Regions: ``regions=True`` compiles, inside each target, every block of each ``nn.ModuleList`` /
    ``nn.Sequential`` of two or more modules of one class (a transformer's layers) on its own, and leaves the rest
    of the target (embeddings, head) eager. The blocks share one compiled graph, so the cold start is that of one
    block, not of the whole model; the steady step may lose the fusions across blocks and the head
    (docs/techniques/compile.md has the measured trade-off).

    Fallback: if ``torch.compile`` is unavailable on the platform or compiling raises (a backend failure, a graph
    break under ``fullgraph=True``, a missing C++ compiler for inductor), the target runs eagerly from then on
    with one warning that gives the reason; training does not stop. ``fallback_reason`` keeps it.

    Attributes (no keys are logged):

    =========================  =======  ===============================================================
    attribute                  unit     meaning (this process)
    =========================  =======  ===============================================================
    ``warmup_batches``         batches  batches to exclude from throughput/MFU measurement
    ``compiled_names``         names    modules running compiled (empty after a fallback)
    ``first_call_seconds``     s        wall time of each target's first call (compilation + one forward)
    ``fallback_reason``        text     why compilation was abandoned, or ``None``
    =========================  =======  ===============================================================

    Args:
        modules: targets (see above); ``None`` for the model's direct children with parameters.
        mode: ``torch.compile`` mode: ``None``/``"default"``, ``"reduce-overhead"`` (CUDA graphs),
            ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``.
        dynamic: ``torch.compile(dynamic=...)``: ``None`` (recompile as dynamic on a shape change), ``True``,
            ``False``.
        fullgraph: fail (and so fall back) on any graph break instead of splitting the graph.
        backend: ``"inductor"`` (default), ``"aot_eager"``, ``"eager"``, ... or a backend callable.
        options: inductor options dict passed to ``torch.compile``.
        warmup_batches: batches to leave out of measurements (compilation, first recompiles).
        regions: compile the repeated blocks inside the targets one by one instead of each target whole (see
            above); a target without repeated blocks raises ``ValueError``.
    """

    def __init__(
        self,
        *,
        modules: Sequence[str | type] | None = None,
        mode: str | None = None,
        dynamic: bool | None = None,
        fullgraph: bool = False,
        backend: str | Callable[..., Any] = "inductor",
        options: dict[str, Any] | None = None,
        warmup_batches: int = 3,
        regions: bool = False,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"TorchCompile(mode={mode!r}): use one of {', '.join(map(repr, _MODES))}")
        if dynamic not in (None, True, False):
            raise ValueError(f"TorchCompile(dynamic={dynamic!r}): use None, True or False")
        if not isinstance(backend, str) and not callable(backend):
            raise ValueError(
                f"TorchCompile(backend={backend!r}): give a backend name such as 'inductor' or "
                "'aot_eager', or a backend callable"
            )
        if mode is not None and options is not None:
            raise ValueError("TorchCompile: torch.compile accepts `mode` or `options`, not both; drop one")
        check_int("TorchCompile", "warmup_batches", warmup_batches, minimum=0, unit="batches", example=3)
        if regions not in (True, False):
            raise ValueError(f"TorchCompile(regions={regions!r}): use True (each repeated block) or False (whole)")
        self.regions = bool(regions)
        if isinstance(modules, (str, type)):
            modules = [modules]
        self.modules = list(modules) if modules is not None else None
        self.compile_kwargs: dict[str, Any] = {"dynamic": dynamic, "fullgraph": fullgraph, "backend": backend}
        if mode is not None:
            self.compile_kwargs["mode"] = mode
        if options is not None:
            self.compile_kwargs["options"] = options
        self.warmup_batches = warmup_batches
        self.compiled_names: list[str] = []
        self.first_call_seconds: dict[str, float] = {}
        self.fallback_reason: str | None = None
        self._targets: list[tuple[str, nn.Module]] = []

    # ------------------------------------------------------------------ targets
    def _select(self, pl_module: pl.LightningModule) -> list[tuple[str, nn.Module]]:
        if self.modules is None:
            found = [(n, m) for n, m in pl_module.named_children() if any(True for _ in m.parameters())]
            if not found:
                raise ValueError(
                    f"TorchCompile: {type(pl_module).__name__} has no child module with parameters to "
                    "compile; pass modules=[...] naming what to compile"
                )
            return found
        found: list[tuple[str, nn.Module]] = []
        missing = []
        everything = [(n, m) for n, m in pl_module.named_modules() if n]
        # names are matched without wrapper segments; an activation-checkpointing wrapper stands for its module
        by_name = [(clean_module_name(n), m) for n, m in everything if not n.endswith(CHECKPOINT_PREFIX)]
        for target in self.modules:
            if isinstance(target, str):
                hits = [(n, m) for n, m in by_name if fnmatch.fnmatchcase(n, target)]
            else:
                hits = [(clean_module_name(n), m) for n, m in everything if isinstance(m, target)]
            if not hits:
                missing.append(target)
            found.extend(h for h in hits if all(h[1] is not m for _, m in found))
        if missing:
            shown = ", ".join(t.__name__ if isinstance(t, type) else repr(t) for t in missing)
            raise ValueError(
                f"TorchCompile(modules=...): {shown} matched no submodule of "
                f"{type(pl_module).__name__}; names present include {[n for n, _ in by_name][:12]}"
            )
        # a target inside another target is compiled as part of it
        inside = {id(sub) for _, m in found for sub in m.modules() if sub is not m}
        return [(n, m) for n, m in found if id(m) not in inside]

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._targets:  # already compiled by an earlier fit/validate with this callback
            return
        self._targets = self._select(pl_module)
        if self.regions:
            self._targets = _repeated_blocks(self._targets)
            if _torch_release() < REGIONS_SHARE_GRAPHS_FROM:
                rank_zero_warn(
                    f"TorchCompile(regions=True) on torch {torch.__version__}: the blocks may each compile their own "
                    f"graph (torch 2.6 guards each block; {'.'.join(map(str, REGIONS_SHARE_GRAPHS_FROM))} shares one), "
                    "so the cold start is not cut, and blocks beyond torch._dynamo.config.cache_size_limit run "
                    "eagerly; upgrade torch, or compile the model whole (regions=False)"
                )
        for name, module in self._targets:
            try:
                compiled = torch.compile(_user_frame(module), **self.compile_kwargs)
            except Exception as err:  # noqa: BLE001 - e.g. "Dynamo is not supported on Python 3.x", Windows without triton
                self._fall_back(f"torch.compile is unavailable here: {err!r}")
                return
            _compat.set_compiled_call(module, self._guarded(name, module, compiled))
            self.compiled_names.append(name)
        rank_zero_info(
            f"TorchCompile: compiling {', '.join(self.compiled_names)} lazily on the first batch ({self._describe()})"
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)

    def _describe(self) -> str:
        kw = dict(self.compile_kwargs)
        backend = kw.pop("backend")
        kw["backend"] = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        if self.regions:
            kw["regions"] = True
        return ", ".join(f"{k}={v!r}" for k, v in kw.items())

    def _guarded(self, name: str, module: nn.Module, compiled: Callable[..., Any]) -> Callable[..., Any]:
        dynamo_error = _compat.dynamo_exception()
        eager = _compat.call_impl(module)

        def call(*args: Any, **kwargs: Any) -> Any:
            if _dispatch_mode_active():
                # e.g. MFUMonitor's FlopCounterMode on the first batch: dynamo would give up on this code for
                # good (every later call eager); run this call eagerly and compile on the next one
                return eager(*args, **kwargs)
            first = name not in self.first_call_seconds
            start = time.perf_counter() if first else 0.0
            try:
                out = compiled(*args, **kwargs)
            except dynamo_error as err:
                self._fall_back(f"compiling {name} failed: {type(err).__name__}: {_first_lines(err)}")
                return eager(*args, **kwargs)
            if first:
                self.first_call_seconds[name] = time.perf_counter() - start
            return out

        return call

    def _fall_back(self, reason: str) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = reason
            rank_zero_warn(
                f"TorchCompile: {reason}. Running eagerly instead (training continues, without the compile speed-up)."
            )
        for _, module in self._targets:
            _compat.set_compiled_call(module, None)
        self.compiled_names.clear()

    def uncompile(self) -> None:
        """Return the targets to eager execution (they otherwise stay compiled after ``fit``)."""
        for _, module in self._targets:
            _compat.set_compiled_call(module, None)
        self._targets, self.compiled_names = [], []


#: The torch release on which the repeated blocks were measured to share one compiled graph (2.6 compiles one per
#: block: dynamo guards each block's identity there).
REGIONS_SHARE_GRAPHS_FROM = (2, 13)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _repeated_blocks(targets: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks of each target's containers (``nn.ModuleList`` / ``nn.Sequential``) holding two or more modules of
    one class, outermost containers first (a block inside a repeated block is compiled with it), by qualified name.
    A target without any raises ``ValueError``: regions would compile nothing of it."""
    blocks: list[tuple[str, nn.Module]] = []
    for target_name, target in targets:
        found: list[tuple[str, nn.Module]] = []
        taken: list[str] = []  # the blocks' names inside the target: what is inside them is compiled with them
        for name, container in target.named_modules():
            if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
                continue
            children = list(container.named_children())
            if len({type(m) for _, m in children}) != 1 or not any(True for _ in container.parameters()):
                continue
            if any(name.startswith(f"{block}.") for block in taken):
                continue
            prefix = ".".join(p for p in (target_name, name) if p)
            found.extend((f"{prefix}.{child}", m) for child, m in children)
            taken.extend(f"{name}.{child}" if name else child for child, _ in children)
        if not found:
            raise ValueError(
                f"TorchCompile(regions=True): {target_name} ({type(target).__name__}) has no nn.ModuleList or "
                "nn.Sequential of two or more blocks of one class; compile it whole (regions=False) or name the "
                "blocks with modules=['model.layers.*']"
            )
        blocks.extend((n, m) for n, m in found if all(m is not b for _, b in blocks))
    return blocks


def _user_frame(module: nn.Module) -> Callable[..., Any]:
    """``module``'s call as a function defined outside ``torch.nn``, with one code object per module class.

    Dynamo does not start tracing in frames of torch's own modules (``nn.Linear``, ``nn.Sequential``, ...):
    compiling their ``_call_impl`` directly silently runs eagerly (torch's ``OptimizedModule`` adds a frame with
    ``external_utils.wrap_inline`` for the same reason). Dynamo caches compiled code per code object, up to
    ``torch._dynamo.config.recompile_limit`` entries, then runs that code eagerly: one code object per class keeps
    different classes from competing for entries, while instances of one class (the repeated blocks of a
    transformer) share them and, with ``inline_inbuilt_nn_modules`` (default since torch 2.5), one graph.
    """
    code = _CODE_PER_CLASS.get(type(module))
    if code is None:
        code = _template(module).__code__.replace(co_name=f"compiled_{type(module).__name__}")
        _CODE_PER_CLASS[type(module)] = code
    return types.FunctionType(code, globals(), code.co_name, None, (types.CellType(_compat.call_impl(module)),))


def _template(module: nn.Module) -> Callable[..., Any]:
    eager = _compat.call_impl(module)

    def run(*args: Any, **kwargs: Any) -> Any:
        return eager(*args, **kwargs)

    return run


_CODE_PER_CLASS: dict[type, types.CodeType] = {}


def _dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (``FlopCounterMode``, a profiler mode, ...) is active in this thread."""
    return _compat.current_dispatch_mode() is not None


def _first_lines(err: BaseException, lines: int = 2, chars: int = 300) -> str:
    """The first non-empty ``lines`` of an error message on one line (dynamo appends long hints after them)."""
    kept = [line.strip() for line in str(err).splitlines() if line.strip()][:lines]
    return " ".join(kept)[:chars]
