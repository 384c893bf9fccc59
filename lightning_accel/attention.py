"""Attention fast paths: choose SDPA backends, see which one ran, and route slow attention to the fused kernels.

* :func:`sdpa_backends` — a context manager (and decorator) over ``torch.nn.attention.sdpa_kernel`` that allows or
  forbids backends by name (``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``) and refuses, naming what the
  device has, a backend the device lacks.
* :class:`SDPABackendRecorder` — counts which backend each ``scaled_dot_product_attention`` call actually ran, so a
  silent fall-back to the (slow, memory-hungry) math path can be named.
* :func:`use_fused_attention` — switches Hugging Face models to the library's own SDPA attention, makes
  ``nn.MultiheadAttention`` modules whose attention weights are never used run with ``need_weights=False`` (which
  lets them use the fused SDPA kernels), and rewrites the hand-written pattern ``softmax(q @ k^T * scale + mask) @
  v`` (as Hugging Face eager, nanoGPT and timm write it) inside modules the user names into one
  ``F.scaled_dot_product_attention`` call; a rewrite that never fires says which op broke the pattern.

Why it matters: ``need_weights=True`` (``nn.MultiheadAttention``'s default!) and hand-written attention both
materialise the ``L x S`` score matrix in memory and run softmax as separate kernels; FlashAttention-style kernels
tile it in on-chip memory (Dao et al., 2022, "FlashAttention", arXiv:2205.14135).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from lightning_accel import _compat
from lightning_accel._compat import TorchDispatchMode

_compat.require_versions("the attention helpers", lightning=False)  # sdpa_kernel(set_priority=): torch 2.6

__all__ = ["ATTENTION_FIX", "FusedAttention", "SDPABackendRecorder", "available_sdpa_backends", "sdpa_backends",
           "use_fused_attention"]

BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


# ---------------------------------------------------------------------------------------------------------------
# choosing backends
# ---------------------------------------------------------------------------------------------------------------

def available_sdpa_backends(device: torch.device | str | None = None) -> tuple[str, ...]:
    """SDPA backends the device can run at all (inputs may still rule a fused one out, e.g. fp32 on flash).

    CPU: ``math`` and ``flash`` (``aten._scaled_dot_product_flash_attention_for_cpu``). CUDA, by compute capability
    as PyTorch's ``sdp_utils.cpp`` checks it: ``flash`` needs a FlashAttention build and sm80+; ``efficient``
    (xFormers' memory-efficient kernel) sm50+; ``cudnn`` cuDNN >= 9 and sm80+. ``math`` runs everywhere.

    Args:
        device: default: the current CUDA device if CUDA is available, else CPU.
    """
    device = _resolve_device(device)
    if device.type == "cpu":
        return ("flash", "math")
    if device.type != "cuda":
        return ("math",)
    major, minor = torch.cuda.get_device_capability(device)
    capability = (major, minor)
    found = []
    if torch.backends.cuda.is_flash_attention_available() and (capability >= (8, 0) or torch.version.hip):
        found.append("flash")
    if capability >= (5, 0) or torch.version.hip:
        found.append("efficient")
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn_version is not None and cudnn_version >= 90000 and capability >= (8, 0):
        found.append("cudnn")
    found.append("math")
    return tuple(found)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class sdpa_backends(contextlib.ContextDecorator):  # noqa: N801 - used like a function: ``with sdpa_backends(...)``
    """Allow only some SDPA backends (in order of preference), or forbid some, inside a ``with`` block.

    ``with sdpa_backends("flash", "efficient"):`` runs attention only on those kernels (in that priority order),
    erroring inside ``scaled_dot_product_attention`` when the inputs suit neither — a way to *prove* the fused
    kernel runs. ``with sdpa_backends(forbid="math"):`` allows every available backend but the slow one. Also works
    as a decorator (``@sdpa_backends("flash")``) on a ``training_step``.

    Args:
        *allow: backend names to allow, by preference; default: every backend the device has.
        forbid: names to leave out (a backend the device lacks is simply not there to forbid).
        device: whose backends to check against; default: the current CUDA device if any, else CPU.

    Raises:
        ValueError: an unknown name, a backend the device lacks (the message names the available ones), or
            nothing left to run.
    """

    def __init__(self, *allow: str, forbid: str | Iterable[str] = (), device: torch.device | str | None = None
                 ) -> None:
        forbid = (forbid,) if isinstance(forbid, str) else tuple(forbid)
        for name in (*allow, *forbid):
            if name not in BACKENDS:
                raise ValueError(f"sdpa_backends: unknown backend {name!r}; choose from {sorted(BACKENDS)}")
        dev = _resolve_device(device)
        available = available_sdpa_backends(dev)
        missing = [name for name in allow if name not in available]
        if missing:
            raise ValueError(f"sdpa_backends: {', '.join(missing)} not available on {dev}"
                             f" ({_describe(dev)}); available there: {', '.join(available)}")
        chosen = [name for name in (allow or available) if name not in forbid]
        if not chosen:
            raise ValueError(f"sdpa_backends(allow={allow}, forbid={forbid}): no backend left to run attention on "
                             f"{dev}; available there: {', '.join(available)}")
        self.backends: tuple[str, ...] = tuple(dict.fromkeys(chosen))
        self.device = dev
        self._priority = bool(allow)
        self._contexts: list[Any] = []

    def __enter__(self) -> sdpa_backends:
        ctx = sdpa_kernel([BACKENDS[name] for name in self.backends], set_priority=self._priority)
        ctx.__enter__()
        self._contexts.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._contexts.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"sdpa_backends({', '.join(map(repr, self.backends))}, device={str(self.device)!r})"


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}, sm{major}{minor}"
    return device.type


# ---------------------------------------------------------------------------------------------------------------
# seeing which backend ran
# ---------------------------------------------------------------------------------------------------------------

_FUSED_OPS: dict[str, str] = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
}


class _FusedOpCounter(TorchDispatchMode):
    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__()
        self.counts = counts
        self.fused_seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        backend = _FUSED_OPS.get(_compat.op_packet_name(func))  # forward ops only: backward ops have other names
        if backend is not None:
            self.counts[backend] += 1
            self.fused_seen += 1
        return func(*args, **(kwargs or {}))


class SDPABackendRecorder:
    """Counts which SDPA backend ran, while the ``with`` block runs.

    ``with SDPABackendRecorder() as rec: model(x)`` then ``rec.counts == {"flash": n, "efficient": n, "cudnn": n,
    "math": n}``: fused kernels are counted as the aten ops they dispatch to (forward calls; backward kernels are
    not counted again); ``math`` counts calls of ``torch.nn.functional.scaled_dot_product_attention`` that reached no
    fused op (the math path is a composite that decomposes into matmul/softmax), plus ``nn.MultiheadAttention``
    calls with ``need_weights=True`` (``F.multi_head_attention_forward`` then computes attention with explicit
    bmm + softmax and never calls SDPA). :attr:`calls` is the number of attention calls seen (SDPA calls plus those
    MHA calls).

    Limits: calls through a reference taken before the block (``from torch.nn.functional import
    scaled_dot_product_attention`` at import time) are seen only when they reach a fused op; code compiled by
    ``torch.compile`` is not seen (its kernels run outside the dispatcher); ``nn.MultiheadAttention``'s C++
    inference fast path (``_native_multi_head_attention``) is not seen. The dispatch mode adds Python work to every
    op while active: record a few steps, not a whole run.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {name: 0 for name in BACKENDS}
        self.calls = 0
        self._mode: _FusedOpCounter | None = None
        self._original: Callable[..., torch.Tensor] | None = None
        self._original_mha: Callable[..., Any] | None = None

    @property
    def math_fallback(self) -> bool:
        """Whether any attention call ran on the math path."""
        return self.counts["math"] > 0

    @property
    def backend(self) -> str | None:
        """The backend of most calls (``None`` without attention); ``"math"`` wins ties, since one math call is
        already what ``BottleneckDoctor``'s attention rule reports."""
        top = max(self.counts.values())
        if top == 0:
            return None
        winners = [name for name, n in self.counts.items() if n == top]
        return "math" if "math" in winners else winners[0]

    def __enter__(self) -> SDPABackendRecorder:
        mode = _FusedOpCounter(self.counts)
        original = F.scaled_dot_product_attention

        def counting_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
            before = mode.fused_seen
            out = original(*args, **kwargs)
            self.calls += 1
            if mode.fused_seen == before:
                self.counts["math"] += 1
            return out

        original_mha = F.multi_head_attention_forward

        def counting_mha(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("need_weights", True):
                # the explicit bmm-softmax-bmm path: unfused, whatever the SDPA settings
                self.calls += 1
                self.counts["math"] += 1
            return original_mha(*args, **kwargs)

        self._mode, self._original, self._original_mha = mode, original, original_mha
        # nn.MultiheadAttention calls F.multi_head_attention_forward, which looks scaled_dot_product_attention up
        # in torch.nn.functional's globals: both are found through the module at call time
        F.scaled_dot_product_attention = counting_sdpa
        F.multi_head_attention_forward = counting_mha
        mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        F.scaled_dot_product_attention = self._original  # type: ignore[assignment]
        F.multi_head_attention_forward = self._original_mha  # type: ignore[assignment]
        self._mode = None

    def __repr__(self) -> str:
        return f"SDPABackendRecorder(calls={self.calls}, counts={self.counts})"


# ---------------------------------------------------------------------------------------------------------------
# routing slow attention to SDPA
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class FusedAttention:
    """What :func:`use_fused_attention` changed.

    Attributes:
        mha: names of ``nn.MultiheadAttention`` modules that now run with ``need_weights=False``.
        kept: names of ``nn.MultiheadAttention`` modules left alone because their weights are used.
        blocks: names of hand-written blocks whose attention pattern is now rewritten.
        fused_calls: per block, how many times the pattern was replaced by one SDPA call so far (0 means the
            block's code did not match the pattern: it still runs, unchanged).
        not_fired: per block whose first forward fused nothing, the first op that broke the pattern (also warned).
        library: Hugging Face models (by module name) switched to the library's own SDPA attention, with the
            implementation they ran before (``"eager"``).
        unswitchable: Hugging Face models whose attention could not be switched, with the reason (also warned);
            their attention modules are rewritten instead.
    """

    mha: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    blocks: list[str] = dataclasses.field(default_factory=list)
    fused_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    not_fired: dict[str, str] = dataclasses.field(default_factory=dict)
    library: dict[str, str] = dataclasses.field(default_factory=dict)
    unswitchable: dict[str, str] = dataclasses.field(default_factory=dict)
    _handles: list[Any] = dataclasses.field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Undo every change (remove the hooks, switch Hugging Face models back)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _SwitchBack:
    """A handle that puts a Hugging Face model back on the attention implementation it had."""

    def __init__(self, model: nn.Module, implementation: str) -> None:
        self.model, self.implementation = model, implementation

    def remove(self) -> None:
        self.model.set_attn_implementation(self.implementation)  # type: ignore[operator]


# --- Hugging Face models: the library's own switch -----------------------------------------------------------------

_FUSED_HF = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def _hf_models(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost ``transformers`` models inside ``model`` (by module name)."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(name == outer or name.startswith(outer + ".") or outer == "" for outer in found):
            continue
        if _compat.hf_attn_implementation(module) is not None:
            found[name] = module
    return found


def _switch_hf(name: str, model: nn.Module) -> str | None:
    """Switch one Hugging Face model to ``attn_implementation="sdpa"``; the reason when it cannot be done."""
    before = _compat.hf_attn_implementation(model)
    if before in _FUSED_HF or (isinstance(before, str) and before.startswith("kernels-")):
        return None  # already fused
    label = f"{type(model).__name__}{f' ({name})' if name else ''}"
    if not hasattr(model, "set_attn_implementation"):
        import transformers

        return (f"{label}: transformers {transformers.__version__} has no set_attn_implementation (added in "
                "4.5x); build the model with attn_implementation='sdpa' (from_pretrained / from_config) instead")
    try:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    except (ValueError, ImportError, NotImplementedError) as err:  # e.g. the class has _supports_sdpa = False
        return f"{label}: set_attn_implementation('sdpa') refused: {err}"
    now = _compat.hf_attn_implementation(model)
    if now != "sdpa":
        return (f"{label}: set_attn_implementation('sdpa') left it on {now!r} (the class does not dispatch through "
                "transformers' AttentionInterface)")
    return None


def _hf_attention_modules(model: nn.Module, prefix: str) -> list[str]:
    """Names of a Hugging Face model's attention modules (class name ending in Attention), outermost only."""
    chosen: list[str] = []
    for name, module in model.named_modules():
        if name and type(module).__name__.endswith("Attention") and \
                not any(name.startswith(outer + ".") for outer in chosen):
            chosen.append(name)
    return [f"{prefix}.{name}" if prefix else name for name in chosen]


def _no_weights_pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # MultiheadAttention.forward(query, key, value, key_padding_mask=None, need_weights=True, ...)
    if len(args) > 4:
        args = (*args[:4], False, *args[5:])
    else:
        kwargs = {**kwargs, "need_weights": False}
    return args, kwargs


class _WeightsProbe(torch.Tensor):
    """Attention weights handed back during the probe forward: any torch use of them marks them as used."""

    _probe_flag: list[bool]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for arg in _flatten((args, kwargs or {})):
            if isinstance(arg, _WeightsProbe):
                arg._probe_flag[0] = True
        with _compat.disable_torch_function_subclass():
            return func(*args, **(kwargs or {}))


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flatten(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _flatten(item)
    else:
        yield obj


def _call(model: nn.Module, example_inputs: Any) -> Any:
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple):
        return model(*example_inputs)
    return model(example_inputs)


def _mha_weights_used(model: nn.Module, mhas: dict[str, nn.MultiheadAttention], example_inputs: Any) -> dict[str, bool]:
    """One example forward; per MHA module called with weights: whether the weights were used (or kept)."""
    probes: dict[str, list[weakref.ref]] = {name: [] for name in mhas}
    flags: dict[str, list[bool]] = {name: [False] for name in mhas}  # outlive the probes
    used: dict[str, bool] = {}

    def make_hook(name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            out, weights = output
            if weights is None:  # called with need_weights=False already
                return output
            probe = weights.as_subclass(_WeightsProbe)
            probe._probe_flag = flags[name]
            probes[name].append(weakref.ref(probe))
            return out, probe
        return hook

    handles = [module.register_forward_hook(make_hook(name)) for name, module in mhas.items()]
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            output = _call(model, example_inputs)
            del output
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():  # the probe must not move BatchNorm statistics & co.
            for name, buf in model.named_buffers():
                if name in buffers and buf.shape == buffers[name].shape:
                    buf.copy_(buffers[name])
    gc.collect()
    for name, refs in probes.items():
        if not refs:
            continue  # not called in the example forward, or never with weights
        # used by a torch op, or still referenced after the forward (stored, returned): treat as used
        used[name] = flags[name][0] or any(ref() is not None for ref in refs)
    return used


def use_fused_attention(model: nn.Module, example_inputs: Any = None, blocks: Iterable[str] = (), *,
                        library_switch: bool = True, warn: bool = True) -> FusedAttention:
    """Route attention in ``model`` to ``F.scaled_dot_product_attention`` where results stay the same.

    1. Hugging Face ``transformers`` models inside ``model`` (found by their config's attention implementation)
       running ``attn_implementation="eager"`` are switched with the library's own
       ``set_attn_implementation("sdpa")``, which keeps masks, dropout and caching as the library means them.
       A model that cannot be switched (no ``set_attn_implementation`` in the installed version, a class without
       SDPA support) is named with the reason in a warning and :attr:`FusedAttention.unswitchable`, and its
       attention modules (class names ending in ``Attention``) are rewritten as in 3. ``library_switch=False``
       skips the switch: named blocks inside such models are then rewritten.
    2. ``nn.MultiheadAttention`` modules. With ``example_inputs``, one forward (no grad, RNG and buffers restored)
       finds the modules called with ``need_weights=True`` whose returned weights are never used — no torch
       operation touches them and nothing keeps them after the forward; those then run with
       ``need_weights=False`` (the fused path) and return ``(output, None)``. Without ``example_inputs``, only
       MHA modules named in ``blocks`` are switched.
    3. Hand-written attention in the modules named in ``blocks``: while such a module runs, the pattern
       ``matmul(q, kt) [* c | / c]* [+ float_mask | .masked_fill(bool_mask, -inf or dtype min)]* ->
       softmax(dim=-1[, dtype=...]) [-> .to(dtype) | .type(dtype) | .float() ...] [-> dropout with p=0 or in
       eval] -> matmul(p, v)`` becomes ``F.scaled_dot_product_attention(q, kt.transpose(-2, -1), v,
       attn_mask=..., scale=c)``. This covers Hugging Face eager attention (Llama, GPT-2, BERT, ViT), nanoGPT's
       manual path and timm-style blocks (a query pre-scaled before the matmul is a scale of 1). Intermediate
       results are lazy placeholders; any other use of one (reading the scores, training-mode dropout with
       p > 0, another ``masked_fill`` value, ...) computes the original operations exactly as written, so the
       block never changes its results beyond floating-point rounding. Attention weights returned next to the
       output (Hugging Face's ``attn_weights``) stay placeholders that compute only if something uses them.
       Under autocast, q, k, v are cast to the autocast dtype as the original matmuls would. Rows masked
       entirely with ``-inf`` give 0 in the fused kernel and NaN in the original. A block whose first forward
       fused nothing warns once, naming the first op that broke the pattern (:attr:`FusedAttention.not_fired`).
       Meant for eager mode: under ``torch.compile``, Inductor's own pattern matcher (``fuse_attention``)
       rewrites many such patterns, and the hooks and ``TorchFunctionMode`` used here are best left out of
       compiled code.

    Args:
        model: the model; changed in place through forward hooks (undo with :meth:`FusedAttention.restore`).
        example_inputs: one input for ``model(...)``: a tensor, a tuple of positional args or a dict of kwargs.
        blocks: names (as in ``model.named_modules()``) of hand-written attention modules, or of MHA modules to
            switch without a probe.
        library_switch: switch Hugging Face models with the library's own setting (default) instead of
            rewriting their eager attention.
        warn: warn about a model that cannot be switched, nothing to change, and a rewrite that never fires;
            ``False`` for callers that report the result themselves (the Autopilot's table): the same facts stay
            in :attr:`FusedAttention.unswitchable` and :attr:`FusedAttention.not_fired`.

    Returns:
        A :class:`FusedAttention` listing what changed.

    Raises:
        ValueError: a name in ``blocks`` that is not a submodule of ``model``.
    """
    blocks = [blocks] if isinstance(blocks, str) else list(blocks)
    modules = dict(model.named_modules())
    unknown = [name for name in blocks if name not in modules]
    if unknown:
        raise ValueError(f"use_fused_attention(blocks={blocks!r}): {unknown} not found in the model; names are as in "
                         f"model.named_modules(), e.g. {list(modules)[1:6]}")
    result = FusedAttention()
    switched: list[str] = []
    already: list[str] = []
    if library_switch:
        for name, hf in _hf_models(model).items():
            before = _compat.hf_attn_implementation(hf)
            if before in _FUSED_HF:
                already.append(name)
            reason = _switch_hf(name, hf)
            if reason is not None:
                result.unswitchable[name] = reason
                inside = [b for b in blocks if b == name or b.startswith(name + ".") or name == ""]
                auto = [] if inside else _hf_attention_modules(hf, name)
                if warn:
                        warnings.warn(f"use_fused_attention: {reason}. Rewriting its hand-written attention instead"
                                  f"{f' ({len(auto)} modules)' if auto else ''}.", UserWarning, stacklevel=2)
                blocks += [b for b in auto if b not in blocks]
            elif before not in _FUSED_HF:
                result.library[name] = str(before)
                result._handles.append(_SwitchBack(hf, str(before)))
                switched.append(name)
    in_switched = [b for b in blocks if any(b == n or b.startswith(n + ".") or n == "" for n in switched)]
    blocks = [b for b in blocks if b not in in_switched]  # the library's SDPA path runs there now
    mhas = {name: m for name, m in modules.items() if isinstance(m, nn.MultiheadAttention)}
    switch = [name for name in blocks if name in mhas]
    if example_inputs is not None and mhas:
        used = _mha_weights_used(model, mhas, example_inputs)
        switch += [name for name, was_used in used.items() if not was_used and name not in switch]
        result.kept = [name for name, was_used in used.items() if was_used and name not in switch]
    for name in switch:
        result._handles.append(mhas[name].register_forward_pre_hook(_no_weights_pre_hook, with_kwargs=True))
        result.mha.append(name)
    for name in blocks:
        if name in mhas:
            continue
        _install_block_rewrite(name, modules[name], result, warn=warn)
        result.blocks.append(name)
    if warn and not result.mha and not result.blocks and not result.library and not already:
        warnings.warn(
            "use_fused_attention: nothing to change: " + (
                f"the MultiheadAttention modules {result.kept} use their attention weights" if result.kept else
                "no nn.MultiheadAttention module called with need_weights=True in the example forward"
                if example_inputs is not None else
                "pass example_inputs to find nn.MultiheadAttention modules, or name hand-written attention "
                "modules in blocks=[...]") + "; the model is unchanged.",
            UserWarning, stacklevel=2)
    return result


# --- hand-written attention: lazy placeholders under a TorchFunctionMode -------------------------------------------

_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_SOFTMAX = {torch.softmax, torch.Tensor.softmax, F.softmax}
_DROPOUT = {F.dropout, torch.dropout}
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
          torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64}
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__,  # type: ignore
    torch.Tensor.layout.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,  # type: ignore
    torch.Tensor.is_floating_point, torch.Tensor.__len__,
}
_STAGE_NAMES = {"scores": "the scores q @ k^T", "masked": "the masked scores", "probs": "the probabilities"}

#: The fix named when a rewrite cannot fire (also what ``BottleneckDoctor``'s attention finding should say).
ATTENTION_FIX = ("call F.scaled_dot_product_attention in the block itself (Hugging Face: "
                 "attn_implementation='sdpa'), or keep the pattern softmax(q @ k^T * c + mask) @ v in one block")


class _Lazy(torch.Tensor):
    """A not-yet-computed step of ``softmax(q @ kt * c + mask) @ v``; computes the original ops when really used."""

    _stage: str  # "scores" (q @ kt, maybe scaled), "masked", "probs"

    @staticmethod
    def __new__(cls, shape: torch.Size, like: torch.Tensor, requires_grad: bool, dtype: torch.dtype | None = None
                ) -> _Lazy:
        return _compat.make_wrapper_subclass(cls, shape, dtype=dtype or like.dtype, device=like.device,
                                             requires_grad=requires_grad)

    def __init__(self, shape: torch.Size, like: torch.Tensor, requires_grad: bool, dtype: torch.dtype | None = None
                 ) -> None:
        self._parent: _Lazy | None = None
        self._op: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None  # replays this step; _SELF = parent
        self._value: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self._kt: torch.Tensor | None = None
        self._scale = 1.0
        self._masks: tuple[torch.Tensor, ...] = ()  # bool (True takes part) or additive float, combined at the end
        self._stage = "scores"
        self._fused = False  # consumed by a fused SDPA call: may leave the block lazy (e.g. returned attn weights)

    def derive(self, stage: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               dtype: torch.dtype | None = None) -> _Lazy:
        child = _Lazy(self.shape, self, self.requires_grad, dtype or self.dtype)
        child._parent, child._op = self, (func, args, kwargs)
        child._q, child._kt, child._scale, child._masks, child._stage = (self._q, self._kt, self._scale,
                                                                         self._masks, stage)
        return child

    def materialize(self) -> torch.Tensor:
        if self._value is None:
            func, args, kwargs = self._op  # type: ignore[misc]
            self._value = func(*_materialize_all(args), **_materialize_all(kwargs))
        return self._value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with _compat.disable_torch_function_subclass():
                return func(*args, **kwargs)
        # outside the rewriting mode (a placeholder that escaped) or an unmatched use: compute the original
        return func(*_materialize_all(args), **_materialize_all(kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"use_fused_attention: a lazy attention intermediate reached {func} without being "
                           "computed; remove this module from blocks=[...] and report the pattern")


def _materialize_all(obj: Any, keep_fused: bool = False) -> Any:
    """``obj`` with its placeholders computed (containers rebuilt only where one was found)."""
    if isinstance(obj, _Lazy):
        if keep_fused and obj._fused and obj._value is None:
            return obj  # e.g. attention weights returned next to the fused output: computed only if used
        return obj.materialize()
    if not any(isinstance(item, _Lazy) for item in _flatten(obj)):
        return obj  # the common case, and a ModelOutput or namedtuple keeps its type untouched
    if isinstance(obj, (list, tuple)):
        items = [_materialize_all(item, keep_fused) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # dict subclasses (Hugging Face's ModelOutput) keep their type and attributes
        for key, value in obj.items():
            out[key] = _materialize_all(value, keep_fused)
        return out
    return obj


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, _Lazy)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on ``device`` right now, ``None`` outside autocast."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


_SOFTMAX_DTYPE: dict[tuple[str, torch.dtype, torch.dtype], torch.dtype] = {}


def _softmax_out_dtype(lazy: _Lazy) -> torch.dtype:
    """softmax's output dtype under the current autocast (CUDA runs softmax in fp32, CPU in the input dtype)."""
    autocast = _autocast_dtype(lazy.device)
    if autocast is None:
        return lazy.dtype
    key = (lazy.device.type, lazy.dtype, autocast)
    if key not in _SOFTMAX_DTYPE:
        with _compat.disable_torch_function_subclass():
            _SOFTMAX_DTYPE[key] = torch.softmax(torch.zeros(1, dtype=lazy.dtype, device=lazy.device), -1).dtype
    return _SOFTMAX_DTYPE[key]


def _cast_target(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of ``t.to(dtype)`` / ``t.to(dtype=...)`` / ``t.type(dtype)`` / ``t.float()`` & co., else None."""
    if func in _CASTS and len(args) == 1 and not kwargs:
        return _CASTS[func]
    if func is torch.Tensor.type and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return args[1]
    if func is torch.Tensor.to:
        if set(kwargs) - {"dtype", "non_blocking", "copy"} or kwargs.get("copy"):
            return None
        if len(args) == 2 and isinstance(args[1], torch.dtype) and "dtype" not in kwargs:
            return args[1]
        if len(args) == 1 and isinstance(kwargs.get("dtype"), torch.dtype):
            return kwargs["dtype"]
    return None


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    return {"__matmul__": "@", "__mul__": "*", "__rmul__": "*", "__truediv__": "/", "__add__": "+",
            "__radd__": "+", "__getitem__": "indexing"}.get(name, name)


def _describe_use(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lazy: _Lazy) -> str:
    """Why this use of a placeholder ends the pattern, in words (for the warning)."""
    name = _op_name(func)
    what = _STAGE_NAMES[lazy._stage]
    if func in _DROPOUT:
        params = dict(zip(("p", "training", "inplace") if func is F.dropout else ("p", "train"), args[1:]))
        params.update(kwargs)
        return (f"dropout(p={params.get('p', 0.5)}) in training mode on {what} (the original ops keep their random "
                "draws; eval mode or p=0 fuses)")
    if func in _SOFTMAX:
        return f"softmax over a dimension other than the last, or with extra arguments, on {what}"
    if func is torch.Tensor.masked_fill:
        return f"masked_fill with a value other than -inf or the dtype's lowest value on {what}"
    if func in _MATMUL and lazy._stage == "probs":
        return f"{name} of {what} with a value tensor of another shape, dtype or device"
    return f"{name} on {what} (only * / by a number, + mask, masked_fill, softmax, casts and dropout follow)"


class _AttentionRewrite(TorchFunctionMode):
    """Active while a listed block runs: turns the attention pattern into one SDPA call (see use_fused_attention)."""

    def __init__(self, on_fused: Callable[[], None]) -> None:
        super().__init__()
        self.on_fused = on_fused
        self.fused = 0
        self.broken: str | None = None  # the first op that ended a pattern, in words
        # 0-dim tensors made by torch.full([], value) in this forward (Hugging Face's scale and mask value): their
        # value is known without reading a GPU tensor back (no device sync)
        self._scalars: dict[int, tuple[torch.Tensor, float]] = {}

    def _scalar(self, value: Any) -> float | None:
        """A Python number, a 0-dim tensor made here by torch.full, or a 0-dim CPU tensor, as a float."""
        if _is_number(value):
            return float(value)
        if _plain(value) and value.ndim == 0 and value.is_floating_point():
            known = self._scalars.get(id(value))
            if known is not None and known[0] is value:
                return known[1]
            if value.device.type == "cpu":
                return float(value.item())
        return None

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        lazies = [a for a in _flatten((args, kwargs)) if isinstance(a, _Lazy)]
        if not lazies:
            if func in _MATMUL and not kwargs and len(args) == 2:
                lazy = self._scores(func, args)
                if lazy is not None:
                    return lazy
            elif func is torch.full and len(args) == 2 and len(args[0]) == 0 and _is_number(args[1]):
                out = func(*args, **kwargs)
                self._scalars[id(out)] = (out, float(args[1]))
                return out
            elif func in _SOFTMAX and args and _plain(args[0]) and self.broken is None:
                self._break("softmax ran on a tensor that is not matmul(q, k^T) of two same-dtype tensors "
                            "(the scores came from an op the rewrite does not follow, e.g. einsum or baddbmm)")
            return func(*args, **kwargs)
        if func in _METADATA:
            return func(*args, **kwargs)
        if len(lazies) == 1:
            out = self._step(func, args, kwargs, lazies[0])
            if out is not None:
                return out
        if any(lazy._value is None for lazy in lazies):
            self._break(_describe_use(func, args, kwargs, lazies[0]))
        return func(*_materialize_all(args), **_materialize_all(kwargs))

    @staticmethod
    def _scores(func: Any, args: tuple[Any, ...]) -> _Lazy | None:
        q, kt = args
        if not (_plain(q) and _plain(kt) and q.is_floating_point() and q.dtype == kt.dtype
                and q.device == kt.device and q.ndim >= 3 and kt.ndim == q.ndim
                and q.shape[:-2] == kt.shape[:-2] and q.shape[-1] == kt.shape[-2]):
            return None
        shape = torch.Size((*q.shape[:-1], kt.shape[-1]))
        dtype = _autocast_dtype(q.device) or q.dtype  # autocast runs matmul in its dtype whatever the inputs
        lazy = _Lazy(shape, q, torch.is_grad_enabled() and (q.requires_grad or kt.requires_grad), dtype)
        lazy._op, lazy._q, lazy._kt = (func, args, {}), q, kt
        return lazy

    def _step(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lazy: _Lazy) -> Any:
        if lazy._value is not None:  # computed already for another use: continue on the real tensor
            return None
        stage = lazy._stage
        if stage == "scores" and len(args) == 2 and not kwargs:
            a, b = args
            factor = self._scalar(b if a is lazy else a)
            if func in _MUL and factor is not None:
                child = lazy.derive("scores", func, args, kwargs)
                child._scale = lazy._scale * factor
                return child
            if func in _DIV and a is lazy and factor is not None and factor != 0:
                child = lazy.derive("scores", func, args, kwargs)
                child._scale = lazy._scale / factor
                return child
        target = _cast_target(func, args, kwargs)
        if target is not None and args[0] is lazy and target == lazy.dtype:
            return lazy  # .to(its own dtype): nothing to do
        if stage in ("scores", "masked") and func in _ADD and len(args) == 2 and not kwargs:
            mask = args[1] if args[0] is lazy else args[0]
            if _plain(mask) and mask.is_floating_point() and mask.device == lazy.device and \
                    torch.broadcast_shapes(mask.shape, lazy.shape) == lazy.shape:
                child = lazy.derive("masked", func, args, kwargs, torch.promote_types(lazy.dtype, mask.dtype))
                child._masks = (*lazy._masks, mask)
                return child
        if stage in ("scores", "masked") and func is torch.Tensor.masked_fill and args[0] is lazy \
                and len(args) == 3 and not kwargs:
            child = self._masked(lazy, func, args, kwargs, masked=args[1], value=args[2])
            if child is not None:
                return child
        if stage in ("scores", "masked") and func is torch.where and len(args) == 3 and args[1] is lazy \
                and not kwargs and _plain(args[0]) and args[0].dtype == torch.bool:
            # torch.where(keep, scores, value) == scores.masked_fill(~keep, value) (GPT-2's causal mask)
            child = self._masked(lazy, func, args, kwargs, masked=~args[0], value=args[2])
            if child is not None:
                return child
        if stage in ("scores", "masked") and func in _SOFTMAX and args[0] is lazy:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            extra = {k: v for k, v in kwargs.items() if k not in ("dim", "_stacklevel", "dtype")}
            dtype = kwargs.get("dtype", args[3] if func is F.softmax and len(args) > 3 else None)
            if dim in (-1, lazy.ndim - 1) and not extra and len(args) <= 2:
                return lazy.derive("probs", func, args, kwargs, dtype or _softmax_out_dtype(lazy))
        if stage == "probs":
            target = _cast_target(func, args, kwargs)
            if target is not None and args[0] is lazy and target.is_floating_point:
                return lazy.derive("probs", func, args, kwargs, target)  # .to(v.dtype) after an fp32 softmax
        if stage == "probs" and func in _DROPOUT and args[0] is lazy:
            params = dict(zip(("p", "training", "inplace") if func is F.dropout else ("p", "train"), args[1:]))
            params.update(kwargs)
            p = params.get("p", 0.5)
            training = params.get("training", params.get("train", True))
            if not params.get("inplace", False) and (p == 0 or not training):
                return lazy  # identity
        if stage == "probs" and func in _MATMUL and len(args) == 2 and args[0] is lazy and not kwargs:
            return self._fuse(lazy, args[1])
        return None

    def _masked(self, lazy: _Lazy, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], masked: Any,
                value: Any) -> _Lazy | None:
        """Scores with ``masked`` positions set to ``value``, when that is a mask SDPA can take."""
        fill = self._scalar(value)
        if not (_plain(masked) and masked.dtype == torch.bool and fill is not None
                and torch.broadcast_shapes(masked.shape, lazy.shape) == lazy.shape):
            return None
        if fill == -math.inf:
            child = lazy.derive("masked", func, args, kwargs)
            child._masks = (*lazy._masks, ~masked)  # SDPA's boolean mask: True takes part
            return child
        if fill == torch.finfo(lazy.dtype).min:
            # the lowest finite value (Hugging Face's mask value): as an additive mask, s + min rounds to min for
            # any score |s| << |min|, so the result is the same, fully masked rows included
            child = lazy.derive("masked", func, args, kwargs)
            additive = torch.zeros(masked.shape, dtype=lazy.dtype, device=lazy.device)
            child._masks = (*lazy._masks, additive.masked_fill(masked, fill))
            return child
        return None

    def _fuse(self, lazy: _Lazy, v: Any) -> torch.Tensor | None:
        q, kt = lazy._q, lazy._kt
        assert q is not None and kt is not None
        if not (_plain(v) and v.is_floating_point() and v.device == q.device and v.ndim == q.ndim
                and v.shape[:-2] == q.shape[:-2] and v.shape[-2] == kt.shape[-1]):
            return None
        autocast = _autocast_dtype(q.device)
        if autocast is None and not (lazy.dtype == v.dtype == q.dtype):
            return None  # the original raises (or promotes in a way the kernel does not): let it run as written
        dtype = autocast or q.dtype
        k = kt.transpose(-2, -1)
        q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (q, k, v))
        mask = _combine_masks(lazy._masks, dtype)
        lazy._fused = True
        self.fused += 1
        self.on_fused()
        if q.ndim == 3:  # (batch*heads, L, E): the fused kernels want (batch, heads, L, E)
            if mask is not None and mask.ndim == 3:
                mask = mask.unsqueeze(1)
            return F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), attn_mask=mask,
                                                  dropout_p=0.0, scale=lazy._scale).squeeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=lazy._scale)


def _combine_masks(masks: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """One SDPA mask from the bool (True takes part) and additive float masks met on the way, in ``dtype``."""
    if not masks:
        return None
    if len(masks) == 1 and (masks[0].dtype == torch.bool or masks[0].dtype == dtype):
        return masks[0]
    total: torch.Tensor | None = None
    for mask in masks:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
        elif mask.dtype != dtype:
            # float32's lowest value (Hugging Face's padding mask) overflows to -inf in bf16/fp16, and a fully
            # masked row (a padded query) would turn NaN where the original gave a finite uniform row
            mask = mask.clamp(min=torch.finfo(dtype).min).to(dtype)
        total = mask if total is None else total + mask
    return total


def _install_block_rewrite(name: str, module: nn.Module, result: FusedAttention, *, warn: bool = True) -> None:
    result.fused_calls[name] = 0
    modes: list[_AttentionRewrite] = []
    warned = [False]

    def on_fused() -> None:
        result.fused_calls[name] += 1

    def pre_hook(mod: nn.Module, args: Any) -> None:
        mode = _AttentionRewrite(on_fused)
        mode.__enter__()
        modes.append(mode)

    def post_hook(mod: nn.Module, args: Any, output: Any) -> Any:
        if not modes:
            return output
        mode = modes.pop()
        mode.__exit__(None, None, None)
        if mode.fused == 0 and result.fused_calls[name] == 0 and not warned[0]:
            warned[0] = True
            reason = mode.broken or "no matmul(q, k^T) -> softmax -> matmul(p, v) ran in the block"
            result.not_fired[name] = reason
            if warn:
                warnings.warn(f"use_fused_attention: the rewrite of {name or 'the model'!r} ({type(mod).__name__}) "
                              f"did not fire in its forward: {reason}. The block runs unchanged; fix: "
                              f"{ATTENTION_FIX}.", UserWarning, stacklevel=2)
        # a placeholder that the fused call did not consume is computed here: nothing half-done leaves the block
        return _materialize_all(output, keep_fused=True)

    result._handles.append(module.register_forward_pre_hook(pre_hook))
    result._handles.append(module.register_forward_hook(post_hook, always_call=True))
