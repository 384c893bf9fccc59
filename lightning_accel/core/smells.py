"""Code smells: well-known slow set-ups found by looking at the model, optimizers and loader before the first step.

:func:`find_smells` is pure apart from the optional preview (:mod:`~lightning_accel.core.optimizer_preview`): each
smell is a :class:`~lightning_accel.core.rules.Finding` with ``kind="smell"`` and a stable name (:data:`SMELLS`),
or a skipped rule with the reason. When each fires: ``docs/measuring/doctor.md``, "The core, module by module".
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from lightning_accel.core.findings import Diagnosis, Finding, SkippedRule
from lightning_accel.core.optimizer_preview import preview_optimizer_step

__all__ = [
    "LIVE_SMELL_MIN_SHARE",
    "SMELLS",
    "find_smells",
    "gate_smells",
    "loader_settings",
    "preview_optimizer_step",
    "smell_share",
]

# BatchNorm statistics degrade below ~32 samples per device and sharply below 16 (Wu & He, "Group Normalization",
# ECCV 2018, Fig. 1).
_BN_SMALL_BATCH = 32
_PREVIEW_MIN_GAIN = 1.10
# Loading a batch in the training process matters from ~1 ms (8 % of a 13 ms step); below, workers cost more in
# start-up and inter-process copies than they save.
_LOAD_MATTERS_S = 0.001


class _Skip(Exception):
    """A smell whose inputs are unknown; the message is the reason."""


@dataclass
class _Inputs:
    model: Any
    optimizers: Sequence[Any]
    loader: dict[str, Any] | None
    device_type: str | None
    device_capability: tuple[int, int] | None
    compute_dtype: str | None
    float32_matmul_precision: str
    accumulate_grad_batches: int
    find_unused_parameters: bool | None
    every_param_got_grad: bool | None
    cpu_count: int | None
    preview: bool
    preview_budget_s: float


def loader_settings(loader: Any, *, time_batch: bool = False, budget_s: float = 0.2) -> dict[str, Any] | None:
    """A ``DataLoader``'s settings as the plain mapping :func:`find_smells` reads (a mapping is returned as a copy,
    anything else gives ``None``): ``num_workers``, ``pin_memory``, ``persistent_workers``, ``batch_size``,
    ``in_memory`` (a ``TensorDataset``), ``iterable`` and, with ``time_batch``, ``load_seconds``: the time to load
    and collate one batch in this process.

    ``load_seconds`` reads samples ``0, 1, ...`` of a map-style data set directly (not through the sampler, whose
    random state the run's order depends on) and passes them to the loader's ``collate_fn``; once ``budget_s`` is
    spent it extrapolates from the samples read. A batch that took 1 ms or more is timed once more and the faster
    reading counts (a first call's warm-up, a scheduler hiccup). Iterable data sets are not timed (that would
    consume them).
    """
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    if isinstance(loader, Mapping):
        return dict(loader)
    if not isinstance(loader, DataLoader):
        return None
    dataset = loader.dataset
    out: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "pin_memory": bool(loader.pin_memory),
        "persistent_workers": bool(loader.persistent_workers),
        "batch_size": loader.batch_size,
        "in_memory": isinstance(dataset, TensorDataset),
        "iterable": isinstance(dataset, IterableDataset),
    }
    if time_batch and not out["iterable"] and not out["in_memory"]:
        try:
            load = _time_one_batch(loader, dataset, budget_s)
            if load is not None and load >= _LOAD_MATTERS_S:
                # once more, the faster counts: a first call's warm-up or one scheduler hiccup made a batch of
                # four zero tensors can take 2.5 ms on a loaded machine (their real cost: ~0.05 ms)
                again = _time_one_batch(loader, dataset, budget_s)
                load = min(load, again) if again is not None else load
            out["load_seconds"] = load
        except Exception:  # noqa: BLE001 - a data set that cannot be indexed this way is not timed
            out["load_seconds"] = None
    return out


def _time_one_batch(loader: Any, dataset: Any, budget_s: float) -> float | None:
    """Seconds to read and collate samples ``0, 1, ...`` of one batch (scaled up when ``budget_s`` cut it short)."""
    size = len(dataset)
    n = min(loader.batch_size or 1, size)
    start = time.perf_counter()
    samples = []
    for i in range(n):
        samples.append(dataset[i])
        if time.perf_counter() - start > budget_s:
            break
    collate = loader.collate_fn
    if loader.batch_size is not None and collate is not None:
        collate(samples)
    took = time.perf_counter() - start
    return took * n / len(samples) if samples else None


# ---------------------------------------------------------------------------------------------------- smells
def _tf32_off(x: _Inputs) -> Finding | None:
    if x.device_type != "cuda":
        raise _Skip("no GPU in use (TF32 is a tensor-core format of Ampere and newer GPUs)")
    if x.device_capability is None or x.compute_dtype is None:
        raise _Skip("device capability or compute dtype unknown")
    if x.device_capability[0] < 8 or x.compute_dtype != "fp32" or x.float32_matmul_precision != "highest":
        return None
    major, minor = x.device_capability
    evidence = (
        f"fp32 matmuls run in full fp32 on a compute-capability {major}.{minor} GPU: "
        "torch.get_float32_matmul_precision() is 'highest', so the TF32 tensor cores stay unused."
    )
    fix = (
        "torch.set_float32_matmul_precision('high') before fit (TF32 matmuls: 10-bit mantissa, fp32 range; "
        "several times the fp32 matmul rate), or train in mixed precision (AutoMixedPrecision)."
    )
    return Finding("tf32_off", "forward", evidence, fix, 1.0, kind="smell")


def _impl_in_use(opt: Any, device_type: str | None) -> str:
    defaults = getattr(opt, "defaults", {}) or {}
    if defaults.get("fused"):
        return "fused"
    if defaults.get("foreach"):
        return "foreach"
    if defaults.get("foreach") is None and not defaults.get("differentiable") and device_type == "cuda":
        return "foreach"  # torch's default on CUDA (torch.optim.optimizer._default_to_fused_or_foreach)
    return "for-loop"


def _candidate(cls: type, device_type: str) -> dict[str, bool] | None:
    params = inspect.signature(cast(Any, cls).__init__).parameters
    from lightning_accel._compat import fused_optimizer_devices

    if "fused" in params and device_type in fused_optimizer_devices():
        return {"fused": True}
    if "foreach" in params:
        return {"foreach": True}
    return None


def _optimizer_not_foreach(x: _Inputs) -> Finding | None:
    if not x.optimizers:
        raise _Skip("no optimizer")
    device = x.device_type or "cpu"
    for opt in x.optimizers:
        cls = type(opt)
        if not cls.__module__.startswith("torch.optim"):
            continue
        if _impl_in_use(opt, device) != "for-loop":
            continue
        candidate = _candidate(cls, device)
        if candidate is None:
            continue
        name = next(iter(candidate))
        gain = None
        if x.preview:
            try:
                loop, fast = preview_optimizer_step(opt, candidate, budget_s=x.preview_budget_s)
                gain = loop / fast if fast > 0 else None
            except Exception as err:  # noqa: BLE001 - no preview: judge without it
                if device != "cuda":
                    raise _Skip(f"{cls.__name__}: the {name} preview failed ({err!r})") from None
        if gain is None and device != "cuda":
            raise _Skip(
                f"{cls.__name__} runs its for-loop on {device}; the gain of {name}=True is unknown without the preview"
            )
        if gain is not None and gain < _PREVIEW_MIN_GAIN:
            continue
        flags = ", ".join(f"{k}={v}" for k, v in (opt.defaults or {}).items() if k in ("foreach", "fused"))
        evidence = f"{cls.__name__}({flags}) updates the parameters one tensor at a time on {device}"
        if gain is not None:
            numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
            evidence += f"; a {name}=True step on clones of the {numel:,} parameters measured {gain:.2f}x faster"
        fix = (
            f"torch.optim.{cls.__name__}(params, ..., {name}=True): one multi-tensor "
            f"{'kernel' if name == 'fused' else 'launch'} for all parameters."
        )
        return Finding("optimizer_not_foreach", "optimizer", evidence + ".", fix, gain or 0.0, gain=gain, kind="smell")
    return None


def _find_unused(x: _Inputs) -> Finding | None:
    if x.find_unused_parameters is None:
        raise _Skip("not a DDP model")
    if not x.find_unused_parameters:
        return None
    if x.every_param_got_grad is None:
        raise _Skip("needs one backward pass to see which parameters get a gradient")
    if not x.every_param_got_grad:
        return None
    evidence = (
        "DDP runs with find_unused_parameters=True, but every parameter got a gradient in the first "
        "backward: DDP walks the autograd graph after every forward for nothing, and cannot start the "
        "all-reduce of a bucket early."
    )
    fix = (
        "strategy='ddp' (find_unused_parameters=False, Lightning's default) or "
        "DDPStrategy(find_unused_parameters=False); keep it only for models that skip layers on some steps."
    )
    return Finding("ddp_find_unused_parameters", "backward", evidence, fix, 1.0, kind="smell")


def _batchnorm(x: _Inputs) -> Finding | None:
    if x.model is None:
        raise _Skip("no model")
    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
    layers = [name for name, m in x.model.named_modules() if isinstance(m, norms) and m.track_running_stats]
    if not layers:
        return None
    if x.accumulate_grad_batches <= 1:
        return None
    batch = (x.loader or {}).get("batch_size")
    if batch is None:
        raise _Skip("micro-batch size unknown")
    if batch >= _BN_SMALL_BATCH:
        return None
    effective = batch * x.accumulate_grad_batches
    evidence = (
        f"{len(layers)} BatchNorm layer(s) ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}) "
        f"normalise each micro-batch of {batch} samples, while gradient accumulation "
        f"(accumulate_grad_batches={x.accumulate_grad_batches}) makes the effective batch {effective}: the "
        f"statistics are those of {batch} samples (noisy below {_BN_SMALL_BATCH})."
    )
    fix = (
        "replace BatchNorm with GroupNorm (torch.nn.GroupNorm(32, channels): batch-independent), or freeze the "
        "BatchNorm statistics of a pre-trained model (m.eval() for the BatchNorm layers during training), or "
        "grow the micro-batch (BatchSizeTuner) and accumulate less; under DDP Trainer(sync_batchnorm=True) "
        "pools the ranks' micro-batches."
    )
    return Finding("batchnorm_accumulation", "forward", evidence, fix, float(batch), kind="smell")


def _dims(x: _Inputs) -> Finding | None:
    if x.device_type != "cuda":
        raise _Skip("no GPU in use (tensor-core tile sizes are a GPU rule)")
    if x.compute_dtype is None:
        raise _Skip("compute dtype unknown")
    if x.compute_dtype not in ("fp16", "bf16"):
        return None
    if x.model is None:
        raise _Skip("no model")
    total = sum(p.numel() for p in x.model.parameters()) or 1
    bad: list[tuple[str, tuple[int, ...], int]] = []
    for name, m in x.model.named_modules():
        if isinstance(m, torch.nn.Linear):
            dims = (m.in_features, m.out_features)
        elif isinstance(m, torch.nn.Embedding):
            dims = (m.num_embeddings, m.embedding_dim)
        elif isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and m.groups == 1:
            dims = (m.in_channels, m.out_channels)
        else:
            continue
        weight = getattr(m, "weight", None)
        n = weight.numel() if isinstance(weight, torch.Tensor) else 0
        if n >= 0.01 * total and any(d % 8 for d in dims):
            bad.append((name or type(m).__name__, dims, n))
    if not bad:
        return None
    share = sum(n for *_, n in bad) / total
    shown = ", ".join(f"{name} {'x'.join(map(str, dims))}" for name, dims, _ in bad[:3])
    evidence = (
        f"{len(bad)} layer(s) holding {100 * share:.0f} % of the weights have sizes that are not multiples "
        f"of 8 ({shown}{', ...' if len(bad) > 3 else ''}): {x.compute_dtype} tensor-core kernels need "
        "multiples of 8 and fall back to slower tiles or padding otherwise."
    )
    fix = (
        "pad the sizes to multiples of 8 (64 for a vocabulary: e.g. 50257 → 50304 tokens, with the extra "
        "logits unused), hidden and head sizes to multiples of 64 where the design allows."
    )
    return Finding("dims_not_multiple_of_8", "forward", evidence, fix, share, kind="smell")


def _dataloader(x: _Inputs) -> dict[str, Any]:
    if x.loader is None:
        raise _Skip("the training data does not come from a torch DataLoader (or it is unknown)")
    return x.loader


def _num_workers_zero(x: _Inputs) -> Finding | None:
    loader = _dataloader(x)
    if loader.get("num_workers") != 0:
        return None
    if loader.get("in_memory"):
        return None  # a TensorDataset indexes tensors in memory: workers would only add IPC
    cores = x.cpu_count
    if cores is None:
        raise _Skip("CPU core count unknown")
    if cores < 2:
        return None
    load = loader.get("load_seconds")
    if load is not None and load < _LOAD_MATTERS_S:
        return None  # loading is cheap here: workers would not pay for their start-up and IPC
    suggest = max(1, min(cores - 1, 4 if x.device_type == "cuda" else max(1, cores // 2)))
    evidence = (
        "DataLoader(num_workers=0): every batch is loaded, decoded and collated in the training process, "
        f"between steps, with {cores} cores available"
    )
    if load is not None:
        evidence += f"; loading one batch of {loader.get('batch_size')} took {1e3 * load:.1f} ms here"
    fix = (
        f"DataLoader(num_workers={suggest}, persistent_workers=True, prefetch_factor=4) loads batches in "
        "parallel while the step runs (DataLoaderTuner searches the values)."
    )
    return Finding("num_workers_zero", "data", evidence + ".", fix, load or 0.0, kind="smell")


def _pin_memory_off(x: _Inputs) -> Finding | None:
    if x.device_type != "cuda":
        raise _Skip("no GPU in use (pinned memory speeds up host→GPU copies)")
    loader = _dataloader(x)
    if loader.get("pin_memory") is not False:
        return None
    evidence = (
        "DataLoader(pin_memory=False) while training on a GPU: each batch is copied through a pageable "
        "staging buffer and the copy cannot overlap compute."
    )
    fix = "DataLoader(pin_memory=True) (+ DevicePrefetcher to copy the next batch on a side stream)."
    return Finding("pin_memory_off", "transfer", evidence, fix, 0.0, kind="smell")


def _persistent_workers_off(x: _Inputs) -> Finding | None:
    loader = _dataloader(x)
    workers = loader.get("num_workers") or 0
    if workers == 0 or loader.get("persistent_workers") is not False:
        return None
    evidence = (
        f"DataLoader(num_workers={workers}, persistent_workers=False): the {workers} worker processes are "
        "started again (and the data set sent to them) for every epoch and every validation run."
    )
    fix = "DataLoader(..., persistent_workers=True) keeps the workers alive across epochs."
    return Finding("persistent_workers_off", "data", evidence, fix, float(workers), kind="smell")


def _hf_eager(x: _Inputs) -> Finding | None:
    if x.model is None:
        raise _Skip("no model")
    for name, m in x.model.named_modules():
        from lightning_accel._compat import hf_attn_implementation, hf_supports_sdpa

        if hf_attn_implementation(m) != "eager" or not hf_supports_sdpa(m):
            continue
        evidence = (
            f"the Hugging Face model {type(m).__name__}{f' ({name})' if name else ''} runs attention with "
            "attn_implementation='eager' (explicit softmax(QK^T)V, the full attention matrix in memory), "
            "though it supports 'sdpa'."
        )
        fix = (
            "load it with from_pretrained(..., attn_implementation='sdpa') (or model.set_attn_implementation("
            "'sdpa')): PyTorch's fused scaled_dot_product_attention kernels (flash / memory-efficient on a GPU)."
        )
        return Finding("hf_eager_attention", "forward", evidence, fix, 1.0, kind="smell")
    return None


_SMELLS: dict[str, Callable[[_Inputs], Finding | None]] = {
    "tf32_off": _tf32_off,
    "optimizer_not_foreach": _optimizer_not_foreach,
    "ddp_find_unused_parameters": _find_unused,
    "batchnorm_accumulation": _batchnorm,
    "dims_not_multiple_of_8": _dims,
    "num_workers_zero": _num_workers_zero,
    "pin_memory_off": _pin_memory_off,
    "persistent_workers_off": _persistent_workers_off,
    "hf_eager_attention": _hf_eager,
}
#: Smell rule names, in evaluation order.
SMELLS: tuple[str, ...] = tuple(_SMELLS)


def find_smells(
    model: Any,
    optimizers: Iterable[Any] = (),
    *,
    loader: Any = None,
    device_type: str | None = None,
    device_capability: tuple[int, int] | None = None,
    compute_dtype: str | None = None,
    float32_matmul_precision: str | None = None,
    accumulate_grad_batches: int = 1,
    find_unused_parameters: bool | None = None,
    every_param_got_grad: bool | None = None,
    cpu_count: int | None = None,
    preview: bool = True,
    preview_budget_s: float = 0.1,
    rules: Iterable[str] | None = None,
) -> Diagnosis:
    """Look for the smells of :data:`SMELLS`; each is a finding with ``kind="smell"`` or a skipped rule.

    Args:
        model: the ``torch.nn.Module`` (``None``: model smells are skipped).
        optimizers: the optimizers (``torch.optim`` ones are inspected).
        loader: the training ``DataLoader``, or a mapping of its settings (:func:`loader_settings`'s keys), or
            ``None`` (loader smells skipped).
        device_type / device_capability: where the step runs (``"cuda"``, ``(8, 0)``).
        compute_dtype: the matmul dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``).
        float32_matmul_precision: defaults to ``torch.get_float32_matmul_precision()``.
        accumulate_grad_batches: micro-batches per optimizer step.
        find_unused_parameters: the DDP flag (``None``: not DDP).
        every_param_got_grad: whether every trainable parameter had a gradient after the first backward (``None``:
            not seen yet).
        cpu_count: cores this process may use.
        preview: time a foreach/fused optimizer step on clones of the parameters (``preview_budget_s`` seconds of
            stepping per optimizer, plus the clones' set-up) to put the measured gain on the finding, and the
            loading of one batch in this process (:func:`loader_settings`, at most 0.2 s).
        rules: evaluate only these rule names (default: all).

    Raises:
        ValueError: an unknown rule name, or ``accumulate_grad_batches`` < 1.
    """
    selected = list(SMELLS) if rules is None else list(rules)
    unknown = sorted(set(selected) - set(SMELLS))
    if unknown:
        raise ValueError(f"find_smells(rules={unknown}): unknown smell(s); known: {list(SMELLS)}")
    if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
        raise ValueError(f"find_smells(accumulate_grad_batches={accumulate_grad_batches!r}): use an integer >= 1")
    inputs = _Inputs(
        model=model,
        optimizers=list(optimizers),
        loader=loader_settings(loader, time_batch=preview),
        device_type=device_type,
        device_capability=device_capability,
        compute_dtype=compute_dtype,
        float32_matmul_precision=float32_matmul_precision or torch.get_float32_matmul_precision(),
        accumulate_grad_batches=accumulate_grad_batches,
        find_unused_parameters=find_unused_parameters,
        every_param_got_grad=every_param_got_grad,
        cpu_count=cpu_count,
        preview=preview,
        preview_budget_s=preview_budget_s,
    )
    out = Diagnosis()
    for name in selected:
        try:
            finding = _SMELLS[name](inputs)
        except _Skip as skip:
            out.skipped.append(SkippedRule(name, str(skip)))
            continue
        except Exception as err:  # noqa: BLE001 - a model the smell cannot inspect is skipped, never fatal
            out.skipped.append(SkippedRule(name, f"could not inspect the model/optimizer ({err!r})"))
            continue
        if finding is not None:
            out.findings.append(finding)
    return out


# ------------------------------------------------------------------------------------------------ the share gate
#: A smell whose fix is expected to save less than this share of the step is listed in the report, not warned live
#: (a warning costs the reader's attention: the demo's for-loop optimizer, 3.4 % of its step, would save ~2.4 %).
LIVE_SMELL_MIN_SHARE = 0.03

#: What the fix of each smell removes of its stage when no preview measured it (the Autopilot's priors,
#: ``core.autopilot.EXPECTED_REMOVAL``); ``None``: not a speed smell (BatchNorm statistics), always warned.
_REMOVABLE: dict[str, float | None] = {
    "tf32_off": 0.3,
    "optimizer_not_foreach": 0.5,
    "ddp_find_unused_parameters": 0.1,
    "batchnorm_accumulation": None,
    "dims_not_multiple_of_8": 0.1,
    "num_workers_zero": 0.9,
    "pin_memory_off": 0.5,
    "persistent_workers_off": 0.1,
    "hf_eager_attention": 0.25,
}


def smell_share(finding: Finding, shares: Mapping[str, float]) -> float | None:
    """The share of the step fixing ``finding`` is expected to save: its stage's share times what the fix removes
    (``1 - 1/gain`` where the preview measured a gain, else the prior); ``None`` when unknown or not about speed."""
    removable = _REMOVABLE.get(finding.rule, 0.0)
    if removable is None or finding.stage not in shares:
        return None
    if finding.gain is not None and finding.gain > 0:
        removable = max(0.0, 1.0 - 1.0 / finding.gain)
    return float(shares[finding.stage]) * removable


def gate_smells(
    findings: Iterable[Finding], shares: Mapping[str, float], min_share: float = LIVE_SMELL_MIN_SHARE
) -> tuple[list[Finding], list[Finding]]:
    """Split smells into those worth a live warning and those for the report only (expected saving below
    ``min_share`` of the step); each carries its expected saving in its evidence."""
    from dataclasses import replace

    live: list[Finding] = []
    report_only: list[Finding] = []
    for finding in findings:
        share = smell_share(finding, shares)
        if share is None:
            live.append(finding)
            continue
        finding = replace(
            finding,
            evidence=f"{finding.evidence} (fixing it is expected to save ~{share:.1%} of the "
            f"step: {finding.stage} is {shares[finding.stage]:.1%} of it)",
        )
        (report_only if share < min_share else live).append(finding)
    return live, report_only
