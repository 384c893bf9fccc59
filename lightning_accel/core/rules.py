"""Bottleneck rules: stage shares of the step time + what is known about the run → findings, each with the fix.

Pure functions over plain data, so every rule is unit-tested with exact numbers. :func:`diagnose` runs every rule,
skips those whose inputs are unknown, and returns the findings largest saving first. The thresholds and their
sources: ``docs/method.md``; the savings: ``docs/measuring/doctor.md``, "The core, module by module".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

# The data model lives in findings.py; re-exported here, where the doctor's users import it from.
from lightning_accel.core.findings import STAGES, Diagnosis, Finding, RunContext, SkippedRule, Thresholds, by_saving
from lightning_accel.core.ranks import find_stragglers, straggler_shares

__all__ = [
    "RULES",
    "STAGES",
    "Diagnosis",
    "Finding",
    "RunContext",
    "SkippedRule",
    "Thresholds",
    "bottleneck_of",
    "by_saving",
    "diagnose",
    "holding_back",
]


class _Skip(Exception):
    """Raised by a rule whose inputs are unknown; the message is the reason shown in the report."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def bottleneck_of(shares: Mapping[str, float]) -> str | None:
    """The stage with the largest share (ties: the earlier stage), or ``None`` when there are no shares."""
    present = [(shares.get(s, 0.0), -i, s) for i, s in enumerate(STAGES) if s in shares]
    if not present or max(present)[0] <= 0:
        return None
    return max(present)[2]


def holding_back(shares: Mapping[str, float], findings: Sequence[Finding]) -> str | None:
    """The stage that holds the run back: the stage of the first finding on a step stage (findings come largest
    saving first; a fit finding's phase is not a stage), or, with none (a balanced run), the largest stage — for a
    healthy run that is forward or backward, i.e. the run is compute-bound. A data wait of 34 % next to a 41 %
    backward is therefore a ``data`` bottleneck: it is the part of the step that should not be there."""
    for finding in findings:
        if finding.stage in STAGES:
            return finding.stage
    return bottleneck_of(shares)


# ---------------------------------------------------------------------------------------------------- the rules
_MIXED_SPEEDUP = 1.5  # the low end of the 1.5-2x the mixed-precision fix names
_FUSED_REMOVAL = 0.5  # the share of an unfused update a foreach/fused one removes (the Autopilot's foreach prior)
#: the stages a rule judges, where they are not just its finding's stage (the compute rules: forward + backward)
_JUDGED = {
    "fp32_compute": ("forward", "backward"),
    "launch_bound": ("forward", "backward"),
    "math_sdpa": ("forward", "backward"),
    "memory": (),
}


def _dali_data_fix(data: float, ctx: RunContext, th: Thresholds) -> Finding:
    """The data rule for a DALI pipeline: its own knobs, not a DataLoader's."""
    evidence = (
        f"waiting for the next batch takes {_pct(data)} of the step time (threshold {_pct(th.data_share)}); "
        f"DALIImageDataModule(decode_device={ctx.decode_device!r}, num_threads={ctx.loader_threads}, "
        f"prefetch_queue_depth={ctx.prefetch_queue_depth})."
    )
    steps = []
    if ctx.decode_device == "cpu" and ctx.device_type == "cuda":
        steps.append("decode on the GPU: decode_device='mixed' (nvJPEG; 'auto' picks it on CUDA)")
    threads, cores = ctx.loader_threads, ctx.cpu_count
    spare_cores = threads is not None and cores is not None and threads < cores
    if spare_cores and threads is not None and cores is not None:
        per_rank = " (the cores are shared by the ranks of a node)" if (ctx.world_size or 1) > 1 else ""
        stage = "the Huffman decoding of nvJPEG" if ctx.decode_device == "mixed" else "decode and augmentation"
        steps.append(
            f"give {stage} more CPU threads: num_threads={min(cores, 2 * threads)} of the {cores} cores{per_rank}"
        )
    if ctx.prefetch_queue_depth is not None and ctx.prefetch_queue_depth < 3:
        steps.append("prefetch_queue_depth=3 (absorbs slow batches)")
    steps.append(
        "if the source images are much larger than the training size, pre-resize the data set once "
        "(e.g. shorter side 256-320 px for 224 px crops): decode time grows with the pixels (3.5x from "
        "500x375 to 1000x750 JPEGs in benchmarks/bench_dali.py)"
    )
    if ctx.decode_device == "cpu" and ctx.device_type != "cuda" and not spare_cores:
        steps.append("every core already decodes: the data rate is this machine's, until more cores or a GPU")
    return Finding("data_wait", "data", evidence, "; ".join(steps) + ".", data, saving=data)


def _rule_data_wait(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    data = shares.get("data", 0.0)
    if data <= th.data_share:
        return None
    if ctx.loader == "DALIImageDataModule":
        return _dali_data_fix(data, ctx, th)
    settings = []
    if ctx.num_workers is not None:
        settings.append(f"num_workers={ctx.num_workers}")
    if ctx.prefetch_factor is not None:
        settings.append(f"prefetch_factor={ctx.prefetch_factor}")
    if ctx.persistent_workers is not None:
        settings.append(f"persistent_workers={ctx.persistent_workers}")
    evidence = (
        f"waiting for the next batch takes {_pct(data)} of the step time (threshold {_pct(th.data_share)})"
        + (f"; DataLoader({', '.join(settings)})" if settings else "")
        + "."
    )
    # Start around 4 workers per GPU, or 1/4-1/2 of the cores (docs/method.md, "Data"), never more than the cores.
    cores = ctx.cpu_count or 4
    steps = []
    if ctx.num_workers is not None and ctx.num_workers == 0:
        suggest = max(1, min(cores, 4 if ctx.device_type == "cuda" else max(1, cores // 2)))
        steps.append(f"load in parallel: DataLoader(num_workers={suggest}, persistent_workers=True, prefetch_factor=4)")
    else:
        more = []
        if ctx.num_workers is not None and ctx.num_workers < cores:
            more.append(f"num_workers={min(cores, 2 * ctx.num_workers)}")
        if ctx.prefetch_factor is None or ctx.prefetch_factor < 4:
            more.append("prefetch_factor=4")
        if ctx.persistent_workers is False:
            more.append("persistent_workers=True")
        steps.append(f"raise the DataLoader's {', '.join(more) or 'num_workers / prefetch_factor'}")
    steps.append("let DataLoaderTuner search num_workers/prefetch_factor for you")
    steps.append("pack many small files into sequential shards (pack_memmap, pack_webdataset)")
    steps.append("decode and augment images on the GPU (DALIImageDataModule)")
    return Finding("data_wait", "data", evidence, "; ".join(steps) + ".", data, saving=data)


def _rule_gpu_utilisation(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    if ctx.device_type != "cuda":
        raise _Skip("no GPU in use")
    if ctx.gpu_utilisation is None:
        raise _Skip("GPU utilisation unknown: NVML unavailable (pip install 'lightning-accel[nvml]')")
    util = ctx.gpu_utilisation
    if util >= th.gpu_utilisation:
        return None
    host = {s: shares.get(s, 0.0) for s in ("data", "transfer", "communication", "other")}
    stage = max(host, key=lambda s: host[s])
    evidence = (
        f"GPU utilisation {_pct(util)} (threshold {_pct(th.gpu_utilisation)}): the GPU idles; the largest "
        f"non-compute stage is {stage} at {_pct(host[stage])} of the step."
    )
    fixes = {
        "data": "feed it faster: more DataLoader workers / prefetch (DataLoaderTuner), packed data (pack_memmap, "
        "pack_webdataset), GPU decode (DALIImageDataModule).",
        "transfer": "overlap the copy: pin_memory=True + DevicePrefetcher.",
        "communication": "shrink the all-reduce: strategy='ddp_bf16_compress' or 'ddp_powersgd', or accumulate "
        "gradients (accumulate_grad_batches).",
        "other": "cut host overhead per step: TorchCompile / CUDA graphs, a larger batch (BatchSizeTuner), fewer "
        "host syncs (.item(), logging every step).",
    }
    if stage == "data" and ctx.loader == "DALIImageDataModule":
        fixes["data"] = _dali_data_fix(host["data"], ctx, th).fix
    return Finding("gpu_utilisation", stage, evidence, fixes[stage], util, saving=host[stage])


def _rule_transfer(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    transfer = shares.get("transfer", 0.0)
    if transfer <= th.transfer_share:
        return None
    evidence = (
        f"the host→device copy of the batch takes {_pct(transfer)} of the step (threshold {_pct(th.transfer_share)})"
    )
    if ctx.pin_memory is None:
        evidence += "."
        fix = (
            "pin_memory=True in the DataLoader + DevicePrefetcher (copies the next batch on a side stream with "
            "non_blocking=True while this one computes); send compact dtypes (uint8 images, int tokens) and "
            "convert on the device."
        )
    elif not ctx.pin_memory:
        evidence += "; pin_memory=False."
        fix = (
            "pin_memory=True + DevicePrefetcher: DataLoader(pin_memory=True) makes the copy asynchronous "
            "(non_blocking=True) and DevicePrefetcher overlaps it with compute; send compact dtypes "
            "(uint8 images, int tokens) and convert on the device."
        )
    else:
        evidence += "; pin_memory is already on."
        fix = (
            "overlap the copy with compute (DevicePrefetcher) and move fewer bytes: uint8 instead of float "
            "images, fp16 output from DALI (DALIImageDataModule), normalise on the device."
        )
    return Finding("transfer", "transfer", evidence, fix, transfer, saving=transfer)


def _rule_fp32_compute(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    if ctx.device_type != "cuda":
        raise _Skip("no GPU in use (tensor cores are a GPU feature)")
    if ctx.device_capability is None or ctx.compute_dtype is None:
        raise _Skip("device capability or compute dtype unknown")
    if ctx.device_capability[0] < 7 or ctx.compute_dtype not in ("fp32", "tf32"):
        return None  # no tensor cores (pre-Volta) or already mixed/low precision
    compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
    if compute < th.compute_share:
        return None
    half = "bf16-mixed" if ctx.device_capability[0] >= 8 else "16-mixed"
    evidence = (
        f"forward+backward take {_pct(compute)} of the step and run in {ctx.compute_dtype} on "
        f"{ctx.device_name or 'a tensor-core GPU'} (compute capability "
        f"{ctx.device_capability[0]}.{ctx.device_capability[1]}), whose tensor cores run "
        f"{'bf16' if half.startswith('bf16') else 'fp16'} several times faster."
    )
    fix = (
        f"train in mixed precision: Trainer(plugins=[AutoMixedPrecision()]) (or precision='{half}'); "
        "typically 1.5-2x on tensor-core GPUs; compare the loss curve once."
    )
    return Finding("fp32_compute", "forward", evidence, fix, compute, saving=compute * (1 - 1 / _MIXED_SPEEDUP))


def _rule_optimizer(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    opt = shares.get("optimizer", 0.0)
    if opt <= th.optimizer_share:
        return None
    name = ctx.optimizer or "the optimizer"
    flags = []
    if ctx.optimizer_fused is not None:
        flags.append(f"fused={ctx.optimizer_fused}")
    if ctx.optimizer_foreach is not None:
        flags.append(f"foreach={ctx.optimizer_foreach}")
    evidence = (
        f"the optimizer step ({name}{'(' + ', '.join(flags) + ')' if flags else ''}) takes {_pct(opt)} of "
        f"the step (threshold {_pct(th.optimizer_share)})."
    )
    impl = (
        "fused=True (one kernel for all parameters)"
        if ctx.device_type == "cuda"
        else "foreach=True (multi-tensor update)"
    )
    fix = f"use a fused/foreach optimizer: e.g. torch.optim.AdamW(params, lr=..., {impl})"
    if (ctx.world_size or 1) > 1:
        fix += (
            "; shard the optimizer state and update across ranks with ZeRO: strategy='deepspeed_zero1' "
            "(or 'deepspeed_zero2')"
        )
    else:
        fix += "; on several GPUs, ZeRO sharding (strategy='deepspeed_zero1'/'deepspeed_zero2') splits the update"
    if (ctx.accumulate_grad_batches or 1) == 1:
        fix += "; gradient accumulation (accumulate_grad_batches=N) runs the step once per N micro-batches"
    return Finding("optimizer", "optimizer", evidence, fix + ".", opt, saving=opt * _FUSED_REMOVAL)


def _rule_communication(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    if ctx.world_size is None:
        raise _Skip("world size unknown")
    if ctx.world_size <= 1:
        raise _Skip("single process: no gradient all-reduce")
    if not ctx.communication_measured:
        raise _Skip("the gradient all-reduce was not timed (no DDP comm hook could be installed)")
    comm = shares.get("communication", 0.0)
    if comm <= th.communication_share:
        return None
    evidence = (
        f"gradient all-reduce not hidden behind backward takes {_pct(comm)} of the step on "
        f"{ctx.world_size} ranks (threshold {_pct(th.communication_share)})."
    )
    bf16 = ctx.device_type == "cuda" and ctx.device_capability is not None and ctx.device_capability[0] >= 8
    first = "strategy='ddp_bf16_compress'" if bf16 else "strategy='ddp_fp16_compress'"
    fix = (
        f"send fewer bytes: {first} (2x less traffic) or strategy='ddp_powersgd' (low-rank, 10-100x less on "
        "slow networks; check convergence); on a slow link with few ranks also 'ddp_qsgd' (4-bit, ~7x) or "
        "'ddp_topk' (1 % of the entries, ~50x; by all-gather: pays while density < 1/ranks); all-reduce less "
        "often with gradient accumulation (accumulate_grad_batches=N: one all-reduce per N micro-batches)."
    )
    return Finding("communication", "communication", evidence, fix, comm, saving=comm)


def _rule_memory(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    if ctx.memory_peak_fraction is None:
        raise _Skip("device memory peak unknown (no GPU in use)")
    if ctx.batch_size is None:
        raise _Skip("batch size unknown")
    peak = ctx.memory_peak_fraction
    if peak < th.memory_fraction or ctx.batch_size > th.small_batch:
        return None
    evidence = (
        f"device memory peaked at {_pct(peak)} of capacity with a per-device batch of only "
        f"{ctx.batch_size} (thresholds {_pct(th.memory_fraction)}, batch <= {th.small_batch})."
    )
    fix = (
        "free memory, then grow the batch: ActivationCheckpointing (recompute activations, ~+20 % compute), "
        "ZeRO sharding (strategy='deepspeed_zero2', 'deepspeed_zero3', or the offload variants "
        "'deepspeed_zero2_offload' / 'deepspeed_zero3_offload'), then BatchSizeTuner."
    )
    return Finding("memory", "forward", evidence, fix, peak)


def _rule_launch_bound(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    if ctx.device_type != "cuda":
        raise _Skip("no GPU in use (MFU versus breakdown is a GPU rule)")
    if ctx.mfu is None:
        raise _Skip("MFU unknown: add MFUMonitor to the callbacks")
    compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
    if compute < th.compute_share:
        return None
    per_compute = ctx.mfu / compute
    if per_compute >= th.mfu_per_compute:
        return None
    evidence = (
        f"forward+backward take {_pct(compute)} of the step but MFU is only {_pct(ctx.mfu)}: during compute "
        f"the GPU delivers {_pct(per_compute)} of its peak (threshold {_pct(th.mfu_per_compute)}), the "
        "signature of small kernels and launch overhead."
    )
    fix = (
        "fuse and batch the work: TorchCompile (torch.compile; mode='reduce-overhead' adds CUDA graphs), a "
        "larger per-device batch (BatchSizeTuner)"
    )
    if ctx.compute_dtype in ("fp32", "tf32"):
        fix += ", mixed precision (AutoMixedPrecision)"
    return Finding(
        "launch_bound",
        "forward",
        evidence,
        fix + ".",
        per_compute,
        saving=compute * (1 - per_compute / th.mfu_per_compute),
    )


def _rule_math_sdpa(shares: Mapping[str, float], ctx: RunContext, th: Thresholds) -> Finding | None:
    if ctx.device_type != "cuda":
        raise _Skip("no GPU in use (fused attention kernels are a GPU rule)")
    if ctx.sdpa_backend is None:
        raise _Skip("no scaled_dot_product_attention call observed")
    if ctx.sdpa_backend != "math":
        return None
    cap = ctx.device_capability
    kernels = "flash and memory-efficient" if cap is not None and cap[0] >= 8 else "memory-efficient"
    evidence = (
        f"attention runs PyTorch's math SDPA kernel (materialises the full attention matrix) on "
        f"{ctx.device_name or 'a GPU'}, which has {kernels} kernels."
    )
    fix = (
        "enable the fused kernels: use_fused_attention(model) / sdpa_backends (flash needs fp16/bf16 inputs, "
        "head_dim <= 256 and no arbitrary attn_mask: use is_causal=True); 3-8x faster attention on long sequences."
    )
    compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
    return Finding("math_sdpa", "forward", evidence, fix, compute)


_RULES: dict[str, Callable[[Mapping[str, float], RunContext, Thresholds], Finding | None]] = {
    "data_wait": _rule_data_wait,
    "gpu_utilisation": _rule_gpu_utilisation,
    "transfer": _rule_transfer,
    "fp32_compute": _rule_fp32_compute,
    "optimizer": _rule_optimizer,
    "communication": _rule_communication,
    "memory": _rule_memory,
    "launch_bound": _rule_launch_bound,
    "math_sdpa": _rule_math_sdpa,
}
#: Rule ids, in evaluation order.
RULES: tuple[str, ...] = tuple(_RULES)


def diagnose(
    shares: Mapping[str, float],
    context: RunContext | None = None,
    thresholds: Thresholds | None = None,
    *,
    rank_seconds: Sequence[Mapping[str, float]] | None = None,
    accounted: Sequence[tuple[str, float, str]] = (),
) -> Diagnosis:
    """Run every rule over the stage shares.

    Args:
        shares: stage → fraction of the step time (keys from :data:`STAGES`; missing stages count as 0).
        context: what else is known; ``None`` fields skip the rules that need them.
        thresholds: where the rules fire (defaults: :class:`Thresholds`).
        rank_seconds: per rank (index = global rank), stage → mean seconds per batch. With two or more ranks the
            straggler rule runs (:func:`~lightning_accel.core.ranks.find_stragglers`), and when it finds one the
            other rules judge the shares without the time the stragglers account for
            (:func:`~lightning_accel.core.ranks.straggler_shares`): their extra time in their slow stage, and the
            other ranks' wait for them in the all-reduce, which is the straggler's cost, not the network's.
        accounted: ``(stage, share of the step, the finding that counts it)`` for time another finding accounts
            for (e.g. ``("data", 0.2, "the validation finding")``): taken out of the stage before the rules judge
            it, and named in the evidence of a finding on that stage.

    Returns:
        findings ordered by :attr:`~Finding.saving` (largest first; :func:`~lightning_accel.core.findings.
        by_saving`), and the skipped rules.
    """
    unknown = sorted(set(shares) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
    for stage, value in shares.items():
        if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise ValueError(f"share of {stage!r} must be a number >= 0, got {value!r}")
    for stage, value, who in accounted:
        if stage not in STAGES or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise ValueError(
                f"accounted time ({stage!r}, {value!r}, {who!r}): give a stage of {list(STAGES)} and a share >= 0"
            )
    ctx = context or RunContext()
    th = thresholds or Thresholds()
    out = Diagnosis()
    stragglers: list[Finding] = []
    taken_out = list(accounted)
    if rank_seconds is not None and len(rank_seconds) > 1:
        stragglers = find_stragglers(rank_seconds, th)
        if stragglers:
            taken_out += [
                (stage, share, "the straggler finding") for stage, share in straggler_shares(rank_seconds, th).items()
            ]
    rule_shares = dict(shares)
    for stage, share, _ in taken_out:
        rule_shares[stage] = max(0.0, rule_shares.get(stage, 0.0) - share)
    found: list[Finding] = []
    for name, rule in _RULES.items():
        try:
            finding = rule(rule_shares, ctx, th)
        except _Skip as skip:
            out.skipped.append(SkippedRule(name, str(skip)))
            continue
        if finding is not None:
            found.append(_name_what_was_taken_out(finding, taken_out))
    out.findings = by_saving(_fold_utilisation(found) + stragglers)
    return out


def _name_what_was_taken_out(finding: Finding, taken_out: Sequence[tuple[str, float, str]]) -> Finding:
    """The finding, its evidence saying which share of its stages another finding counts (so the two add up)."""
    judged = _JUDGED.get(finding.rule, (finding.stage,))
    by_whom: dict[str, float] = {}
    for stage, share, who in taken_out:
        if stage in judged and share >= 0.0005:
            by_whom[who] = by_whom.get(who, 0.0) + share
    if not by_whom:
        return finding
    parts = "; ".join(f"{_pct(share)} of the step, which {who} accounts for" for who, share in by_whom.items())
    return replace(finding, evidence=f"{finding.evidence} Not counted here: {parts}.")


def _fold_utilisation(findings: list[Finding]) -> list[Finding]:
    """A GPU-utilisation finding whose idle stage has its own finding (data wait, transfer, communication) is the
    same seconds with the same fix: its evidence joins that finding instead of a second entry."""
    util = next((f for f in findings if f.rule == "gpu_utilisation"), None)
    if util is None:
        return findings
    same = next((f for f in findings if f is not util and f.stage == util.stage), None)
    if same is None:
        return findings
    joined = replace(same, evidence=f"{same.evidence} Meanwhile: {util.evidence}")
    return [joined if f is same else f for f in findings if f is not util]
