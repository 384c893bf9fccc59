"""Compute findings: what in the model holds forward + backward, and the change that fixes it.

Pure: reads the :class:`~lightning_accel.core.attribution.OpTable` of the doctor's profiled window, from operation
names and input shapes, never class names. Each operation is claimed by one finding at most. The rules, their
thresholds and savings: ``docs/measuring/doctor.md``, "Inside the compute" and "The core, module by module".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_accel.core.attribution import PSEUDO_MODULES, PYTHON_OP, STEP, OpTable, module_pattern
from lightning_accel.core.findings import Finding, RunContext

__all__ = [
    "ATTENTION_MIN_SCORES",
    "COMPUTE_CAUSES",
    "ELEMENTWISE_OPS",
    "MATMUL_OPS",
    "VOCAB_MIN",
    "find_compute_causes",
    "nchw_convolutions",
]

#: the rules, in the order they claim operations
COMPUTE_CAUSES: tuple[str, ...] = (
    "python_loop",
    "eager_attention",
    "large_vocab_loss",
    "unfused_elementwise",
    "nchw_convolution",
    "fp32_matmul",
)

MATMUL_OPS = frozenset(
    {
        "aten::linear",
        "aten::addmm",
        "aten::mm",
        "aten::bmm",
        "aten::matmul",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::einsum",
        "aten::conv1d",
        "aten::conv2d",
        "aten::conv3d",
        "aten::convolution",
        "aten::_convolution",
        "aten::conv_transpose1d",
        "aten::conv_transpose2d",
        "aten::conv_transpose3d",
        "aten::scaled_dot_product_attention",
    }
)
#: operations that read and write their whole input once: a compiler fuses a run of them into one pass
ELEMENTWISE_OPS = frozenset(
    "aten::" + n
    for n in (
        "add add_ sub sub_ rsub mul mul_ div div_ neg pow sqrt rsqrt exp exp_ log log1p tanh tanh_ sigmoid "
        "sigmoid_ relu relu_ gelu gelu_ silu silu_ erf where masked_fill masked_fill_ clamp clamp_ clamp_min "
        "clamp_max minimum maximum abs reciprocal square sin cos sign lerp addcmul addcdiv softplus leaky_relu "
        "hardtanh elu mish hardswish hardsigmoid dropout native_dropout feature_dropout bernoulli_ layer_norm "
        "native_layer_norm group_norm native_group_norm batch_norm native_batch_norm rms_norm mean var std "
        "var_mean sum amax clone contiguous copy_ to _to_copy type_as float fill_ zero_ triu tril"
    ).split()
)
#: views and allocations: no pass over the data, so they neither count in a chain nor break it
_FREE_OPS = frozenset(
    "aten::" + n
    for n in (
        "view reshape _reshape_alias _unsafe_view transpose t permute expand expand_as unsqueeze squeeze slice "
        "select narrow split split_with_sizes chunk unbind as_strided flatten unflatten view_as alias detach "
        "empty empty_like empty_strided zeros zeros_like ones ones_like full full_like arange lift_fresh "
        "resolve_conj resolve_neg"
    ).split()
)
_SOFTMAX_OPS = frozenset({"aten::softmax", "aten::_softmax", "aten::_safe_softmax"})
_LOSS_OPS = frozenset(
    {"aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax", "aten::nll_loss", "aten::nll_loss_nd"}
)
_FP32 = frozenset({"float", "float32", "torch.float32"})
_HALF = frozenset({"c10::BFloat16", "c10::Half", "bfloat16", "float16", "torch.bfloat16", "torch.float16"})
_CONV2D_OPS = frozenset(
    {"aten::conv2d", "aten::convolution", "aten::_convolution", "aten::cudnn_convolution", "aten::conv_transpose2d"}
)

#: Lq x Lk from which hand-written attention scores are worth a fused kernel (a 128 x 128 score matrix)
ATTENTION_MIN_SCORES = 128 * 128
#: classes from which a cross-entropy is a large-vocabulary loss (GPT-2 has 50,257, Llama 2 32,000)
VOCAB_MIN = 8192
_LOOP_MIN_CALLS = 32
_LOOP_MIN_REPEAT = 8
_LOOP_SMALL_NUMEL = 65_536
_CHAIN_MIN = 4
# What each fix takes off the time it claims (the table in docs/measuring/doctor.md).
_ATTENTION_GAIN = 2.0
_LOSS_REMOVABLE = 0.5
_MIXED_SPEEDUP = 1.5  # as core.rules: the low end of the 1.5-2x mixed precision gives
_CHANNELS_LAST_SPEEDUP = 1.2
_MIN_SAVING = 0.03  # as core.smells.LIVE_SMELL_MIN_SHARE


@dataclass
class _Call:
    """One forward operation call and its backward time."""

    step: int
    order: int
    module: str
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str | None
    forward_s: float
    backward_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def key(self) -> tuple[int, int]:
        return self.step, self.order


@dataclass
class _Claim:
    """What one rule found in one module: the seconds it claims and what its fix would save of them."""

    module: str
    seconds: float = 0.0
    saved: float = 0.0
    detail: str = ""
    longest: int = 0
    keys: set[tuple[int, int]] = field(default_factory=set)


def _calls(table: OpTable) -> tuple[list[_Call], dict[str, float]]:
    """Forward calls in step order with their backward seconds; and each module's Python seconds (all steps)."""
    calls: dict[tuple[int, int], _Call] = {}
    python: dict[str, float] = {}
    for r in table.records:
        if r.phase == "forward" and r.name == PYTHON_OP:
            python[r.module] = python.get(r.module, 0.0) + r.seconds
        elif r.phase == "forward" and r.order >= 0:
            calls[(r.step, r.order)] = _Call(r.step, r.order, r.module, r.name, r.shapes, r.dtype, r.seconds)
    for r in table.records:
        if r.phase == "backward" and r.order >= 0 and (r.step, r.order) in calls:
            calls[(r.step, r.order)].backward_s += r.seconds
    return sorted(calls.values(), key=lambda c: c.key), python


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _where(claims: Sequence[_Claim]) -> tuple[str, str]:
    """The costliest module, and a phrase naming the modules (by pattern, with counts)."""
    by_pattern: dict[str, list[_Claim]] = {}
    for c in claims:
        by_pattern.setdefault(module_pattern(c.module), []).append(c)
    ordered = sorted(by_pattern.items(), key=lambda kv: -sum(c.seconds for c in kv[1]))
    top = max(claims, key=lambda c: c.seconds).module
    parts = []
    for pattern, group in ordered[:3]:
        if len(group) > 1:
            example = max(group, key=lambda c: c.seconds).module
            parts.append(f"{pattern} ({len(group)} modules, e.g. {example})")
        else:
            parts.append(group[0].module)
    if len(ordered) > 3:
        parts.append(f"{len(ordered) - 3} more")
    return top, ", ".join(parts)


def _python_loops(calls: Sequence[_Call], python: dict[str, float], steps: int) -> list[_Claim]:
    by_module: dict[str, list[_Call]] = {}
    for c in calls:
        by_module.setdefault(c.module, []).append(c)
    out = []
    for module, group in by_module.items():
        n = len(group) / steps
        distinct = len({(c.name, c.shapes) for c in group})
        if n < _LOOP_MIN_CALLS or n / distinct < _LOOP_MIN_REPEAT:
            continue
        largest = statistics.median(max((_numel(s) for s in c.shapes), default=0) for c in group)
        if largest > _LOOP_SMALL_NUMEL:
            continue
        seconds = sum(c.seconds for c in group) + python.get(module, 0.0)
        out.append(
            _Claim(
                module,
                seconds,
                seconds * (1.0 - distinct / n),
                f"{n:.0f} operations a step, {distinct} distinct, the largest input {largest:.0f} elements",
                keys={c.key for c in group},
            )
        )
    return out


def _eager_attention(calls: Sequence[_Call], taken: set[tuple[int, int]]) -> list[_Claim]:
    claims: dict[str, _Claim] = {}
    by_step_module: dict[tuple[int, str], list[_Call]] = {}
    for c in calls:
        by_step_module.setdefault((c.step, c.module), []).append(c)
    fused = {c.module for c in calls if c.name == "aten::scaled_dot_product_attention"}
    for (_, module), group in by_step_module.items():
        if module in fused:
            continue
        for soft in group:
            if soft.name not in _SOFTMAX_OPS or soft.key in taken or not soft.shapes or len(soft.shapes[0]) < 3:
                continue
            lq, lk = soft.shapes[0][-2], soft.shapes[0][-1]
            if lq * lk < ATTENTION_MIN_SCORES:
                continue
            made = [
                c
                for c in group
                if c.name in MATMUL_OPS
                and c.order < soft.order
                and len(c.shapes) >= 2
                and len(c.shapes[0]) >= 2
                and len(c.shapes[1]) >= 2
                and c.shapes[0][-2] == lq
                and c.shapes[1][-1] == lk
            ]
            if not made:
                continue
            core = [made[-1]] + [c for c in group if any(len(s) >= 2 and tuple(s[-2:]) == (lq, lk) for s in c.shapes)]
            keys = {c.key for c in core} - taken
            seconds = sum(c.seconds for c in core if c.key in keys)
            claim = claims.setdefault(module, _Claim(module))
            claim.seconds += seconds
            claim.saved += seconds * (1.0 - 1.0 / _ATTENTION_GAIN)
            claim.detail = f"softmax over {list(soft.shapes[0])} scores"
            claim.keys |= keys
            taken |= keys
    return list(claims.values())


def _large_vocab(calls: Sequence[_Call], taken: set[tuple[int, int]], vocab_min: int) -> list[_Claim]:
    claims: dict[str, _Claim] = {}
    for loss in calls:
        if loss.name not in _LOSS_OPS or loss.key in taken or not loss.shapes or len(loss.shapes[0]) < 2:
            continue
        vocab = loss.shapes[0][-1]
        if vocab < vocab_min:
            continue
        step = [c for c in calls if c.step == loss.step]
        heads = [
            c
            for c in step
            if c.name in MATMUL_OPS
            and len(c.shapes) >= 2
            and len(c.shapes[1]) == 2
            and (c.shapes[1][0] == vocab if c.name == "aten::linear" else c.shapes[1][-1] == vocab)
        ]
        head = heads[-1] if heads else None
        module = head.module if head is not None else loss.module
        near = {loss.module, module}
        passes = [
            c
            for c in step
            if c.key not in taken
            and c.name not in MATMUL_OPS
            and c.module in near
            and c.shapes
            and len(c.shapes[0]) >= 2
            and c.shapes[0][-1] == vocab
        ]
        keys = {c.key for c in passes}
        seconds = sum(c.seconds for c in passes)
        claim = claims.setdefault(module, _Claim(module))
        claim.seconds += seconds
        claim.saved += seconds * _LOSS_REMOVABLE
        tokens = _numel(loss.shapes[0][:-1])
        claim.detail = (
            f"cross-entropy over {vocab:,} classes for {tokens:,} tokens: logits {list(loss.shapes[0])}, "
            f"{tokens * vocab * 4 / 2**20:.0f} MiB in fp32"
        )
        claim.keys |= keys
        taken |= keys
    return list(claims.values())


def _common_module(modules: Iterable[str]) -> str:
    mods = list(modules)
    if any(m in PSEUDO_MODULES or not m for m in mods):
        return STEP
    parts = [m.split(".") for m in mods]
    prefix: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return ".".join(prefix) if prefix else STEP


def _chains(calls: Sequence[_Call], taken: set[tuple[int, int]]) -> list[_Claim]:
    claims: dict[str, _Claim] = {}

    def close(chain: list[_Call]) -> None:
        if len(chain) < _CHAIN_MIN:
            return
        module = _common_module(c.module for c in chain)
        seconds = sum(c.seconds for c in chain)
        claim = claims.setdefault(module, _Claim(module))
        claim.seconds += seconds
        claim.saved += seconds * (1.0 - 1.0 / len(chain))
        if len(chain) > claim.longest:
            claim.longest = len(chain)
            claim.detail = f"{len(chain)} operations in a row ({', '.join(c.name[6:] for c in chain[:8])}"
            claim.detail += ", ...)" if len(chain) > 8 else ")"
        claim.keys |= {c.key for c in chain}

    chain: list[_Call] = []
    step = -1
    for c in calls:
        if c.step != step:
            close(chain)
            chain, step = [], c.step
        if c.name in _FREE_OPS or (c.name in ELEMENTWISE_OPS and max(map(_numel, c.shapes), default=0) <= 1):
            continue  # no pass over data: views, allocations, arithmetic on scalars (the loss's bookkeeping)
        if c.name in ELEMENTWISE_OPS and c.key not in taken:
            chain.append(c)
        else:
            close(chain)
            chain = []
    close(chain)
    for claim in claims.values():
        taken |= claim.keys
    return list(claims.values())


def _fp32_matmuls(calls: Sequence[_Call], taken: set[tuple[int, int]]) -> list[_Claim]:
    claims: dict[str, _Claim] = {}
    for c in calls:
        if c.name in MATMUL_OPS and c.key not in taken and c.dtype in _FP32:
            claim = claims.setdefault(c.module, _Claim(c.module))
            claim.seconds += c.seconds
            claim.saved += c.seconds * (1.0 - 1.0 / _MIXED_SPEEDUP)
            claim.keys.add(c.key)
            claim.detail = "fp32 matmuls"
    return list(claims.values())


def nchw_convolutions(model: nn.Module) -> tuple[str, ...]:
    """Module paths (as ``model.named_modules()`` spells them) of the 2-D convolutions whose weight is in NCHW: a
    4-D weight that is contiguous in the default format and not in ``channels_last``."""
    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)) or not isinstance(weight, torch.Tensor):
            continue
        # a 1x1 kernel with one input channel is contiguous in both formats: nothing to convert
        if weight.dim() == 4 and not weight.is_contiguous(memory_format=torch.channels_last):
            out.append(name)
    return tuple(out)


def _nchw_convs(calls: Sequence[_Call], taken: set[tuple[int, int]], nchw: Iterable[str]) -> list[_Claim]:
    modules = set(nchw)
    claims: dict[str, _Claim] = {}
    for c in calls:
        if c.name in _CONV2D_OPS and c.key not in taken and c.dtype in _HALF and c.module in modules:
            claim = claims.setdefault(c.module, _Claim(c.module))
            claim.seconds += c.seconds
            claim.saved += c.seconds * (1.0 - 1.0 / _CHANNELS_LAST_SPEEDUP)
            claim.keys.add(c.key)
            claim.detail = "half-precision convolutions in NCHW"
    for claim in claims.values():
        taken |= claim.keys
    return list(claims.values())


def find_compute_causes(
    table: OpTable,
    *,
    context: RunContext | None = None,
    compute_share: float = 1.0,
    min_saving: float = _MIN_SAVING,
    vocab_min: int = VOCAB_MIN,
) -> list[Finding]:
    """The compute findings of a profiled window (docs/measuring/doctor.md), largest saving first.

    Args:
        table: the window's operations (rank 0's).
        context: run facts; ``fp32_matmul`` and ``nchw_convolution`` need ``device_type="cuda"`` and a
            ``device_capability`` >= 7, ``nchw_convolution`` also ``nchw_convolutions`` (the modules to look at).
        compute_share: forward + backward's share of the step (from the stage breakdown): a finding's saving
            is its share of forward + backward times this.
        min_saving: the least saving (share of the step) a finding must have to be reported.
        vocab_min: classes from which a cross-entropy counts as a large-vocabulary loss.
    """
    if not 0.0 <= compute_share <= 1.0 or math.isnan(compute_share):
        raise ValueError(f"find_compute_causes(compute_share={compute_share!r}): use a fraction of the step in [0, 1]")
    if not 0.0 <= min_saving < 1.0:
        raise ValueError(f"find_compute_causes(min_saving={min_saving!r}): use a fraction of the step in [0, 1)")
    steps = max(1, table.steps)
    calls, python = _calls(table)
    total = sum(r.seconds for r in table.records)
    if not calls or total <= 0:
        return []
    taken: set[tuple[int, int]] = set()
    loops = _python_loops(calls, python, steps)
    for claim in loops:
        taken |= claim.keys
    found: dict[str, list[_Claim]] = {
        "python_loop": loops,
        "eager_attention": _eager_attention(calls, taken),
        "large_vocab_loss": _large_vocab(calls, taken, vocab_min),
        "unfused_elementwise": _chains(calls, taken),
        "nchw_convolution": [],
        "fp32_matmul": [],
    }
    cuda = context is not None and context.device_type == "cuda"
    capability = context.device_capability if context is not None else None
    if cuda and capability is not None and capability[0] >= 7:
        found["nchw_convolution"] = _nchw_convs(calls, taken, (context.nchw_convolutions or ()) if context else ())
        found["fp32_matmul"] = _fp32_matmuls(calls, taken)
    findings = []
    for rule in COMPUTE_CAUSES:
        claims = [c for c in found[rule] if c.seconds > 0]
        if not claims:
            continue
        seconds = sum(c.seconds for c in claims)
        saved = sum(c.saved for c in claims)
        saving = saved / total * compute_share
        if saving < min_saving:
            continue
        top, where = _where(claims)
        share = seconds / total
        detail = max(claims, key=lambda c: c.seconds).detail
        findings.append(
            Finding(
                rule,
                "forward",
                _evidence(rule, where, share, detail, seconds / steps),
                _fix(rule, top, context),
                share,
                kind="compute",
                saving=saving,
                module=top,
            )
        )
    findings.sort(key=lambda f: -(f.saving or 0.0))
    return findings


def _evidence(rule: str, where: str, share: float, detail: str, seconds: float) -> str:
    took = f"{share:.1%} of forward + backward ({1e3 * seconds:.2f} ms a step, forward and its backward)"
    if rule == "python_loop":
        return f"{where} runs a Python loop of small operations ({detail}): {took}."
    if rule == "eager_attention":
        return f"{where} computes attention by hand ({detail}; no scaled_dot_product_attention): the score passes take {took}."
    if rule == "large_vocab_loss":
        return f"{where} feeds a large-vocabulary loss ({detail}): the passes over the logits take {took}."
    if rule == "unfused_elementwise":
        return f"{where} run chains of unfused elementwise/normalisation operations (longest: {detail}): {took}."
    if rule == "nchw_convolution":
        return f"{where} run half-precision convolutions with NCHW weights on a tensor-core GPU: {took}."
    return f"{where} run their matmuls in fp32 on a tensor-core GPU: {took}."


def _fix(rule: str, module: str, context: RunContext | None) -> str:
    if rule == "python_loop":
        return (
            f"vectorise the loop in {module}: one batched operation over all iterations (stack the inputs, reduce "
            "over a dimension, torch.vmap) instead of many small ones, or compile it (TorchCompile)."
        )
    if rule == "eager_attention":
        return (
            f"call torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...) in "
            f"{module}.forward instead of softmax(q @ k^T) @ v: one fused kernel that never stores the scores "
            "(use_fused_attention(model) rewrites the attention modules it recognises; a Hugging Face model: "
            "attn_implementation='sdpa')."
        )
    if rule == "large_vocab_loss":
        return (
            f"compute the loss after {module} without the full logits: a chunked or fused linear + cross-entropy, "
            f"loss = lightning_accel.linear_cross_entropy(hidden, {module}.weight, targets) in place of "
            f"cross_entropy({module}(hidden), targets) (a Hugging Face causal LM: "
            "lightning_accel.use_fused_linear_cross_entropy(model), its loss then from labels= without logits; "
            "Liger Kernel's kernel on CUDA when installed); do not upcast the whole logits tensor to fp32."
        )
    if rule == "unfused_elementwise":
        return (
            f"compile the model: Trainer(callbacks=[TorchCompile()]) fuses each chain (e.g. in {module}) into one "
            "kernel; or use the fused operation the chain writes out (F.layer_norm, F.gelu(approximate='tanh'), "
            "F.silu)."
        )
    if rule == "nchw_convolution":
        return (
            "convert the model to channels_last once, before the fit: model = "
            f"model.to(memory_format=torch.channels_last) (the convolutions of {module} and the others then run "
            "the tensor cores' NHWC kernels without a transpose around each call; the Autopilot trials it as "
            "'channels_last'); inputs may stay NCHW, the first convolution converts them."
        )
    half = (
        "bf16-mixed"
        if context is not None and context.device_capability is not None and context.device_capability[0] >= 8
        else "16-mixed"
    )
    return (
        f"train in mixed precision: Trainer(plugins=[AutoMixedPrecision()]) (or precision='{half}'): the "
        f"matmuls of {module} and the others run on the tensor cores; compare the loss curve once."
    )
