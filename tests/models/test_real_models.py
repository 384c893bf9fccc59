"""The collection on models people train: Hugging Face Llama (GQA), GPT-2 (Conv1D, tied head), BERT (padding
mask), ViT (patch conv), litgpt's GPT from a named config and a nanoGPT-style module — tiny configs, CPU.

Per family: one fit with the measuring + numerics + memory stack together (``MFUMonitor``, ``BottleneckDoctor``,
``NonFiniteGuard``, ``ActivationCheckpointing`` on the library's block class, ``AutoMixedPrecision``), one with
``TorchCompile``, one with ``BatchSizeTuner``. The decoders' FLOPs must be within 5 % of ``6·N + 12·L·d·T`` every
time: recomputation under checkpointing and the compiled call are not counted twice.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch

import lightning_accel as la
from tests.models.zoo import FAMILIES, LAYERS, Task, formula_flops_per_batch, skip_reason

NAMES = list(FAMILIES)
PEAK = 1e12  # given, so no CPU matmul probe runs


def family(name: str):
    fam = FAMILIES[name]
    reason = skip_reason(fam)
    if reason:
        pytest.skip(reason)
    return fam


def fit(task: Task, callbacks: list, plugins: list | None = None, steps: int = 4) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins or [],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(task)
    return trainer


def check_flops(task: Task, monitor: la.MFUMonitor) -> None:
    counted = monitor.summary["flops_per_batch"]
    assert counted is not None and counted > 0
    if task.family.decoder:
        expected = formula_flops_per_batch(task.model, task.batch_size)
        assert counted == pytest.approx(expected, rel=0.05), (counted, expected)


@pytest.mark.parametrize("name", NAMES)
def test_measure_guard_checkpoint_and_mixed_precision_together(name):
    fam = family(name)
    task = Task(fam)
    # MFUMonitor's default warm-up (3) ends after batch 1, where ActivationCheckpointing measures what it
    # recomputes (also with a short warm-up: see below)
    monitor = la.MFUMonitor(window=2, warmup_batches=3, peak_flops=PEAK, print_summary=False)
    doctor = la.BottleneckDoctor(
        window=2, warmup_batches=1, report_path=False, print_report=False, warn=False, utilisation=False
    )
    guard = la.NonFiniteGuard()
    ckpt = la.ActivationCheckpointing(modules=[fam.block()])
    amp = la.AutoMixedPrecision()
    fit(task, [monitor, doctor, guard, ckpt], plugins=[amp], steps=7)
    assert len(ckpt.wrapped_names) == LAYERS  # every block of the library's own class, nothing else
    assert ckpt.recompute_flops and ckpt.recompute_flops > 0
    check_flops(task, monitor)  # counted once: the recomputation is subtracted
    assert monitor.summary["mfu"] is not None and monitor.summary["samples_per_sec"] > 0
    assert doctor.report is not None and sum(doctor.report.shares.values()) == pytest.approx(1.0)
    assert guard.bad_steps == 0 and guard.skipped_steps == 0
    assert amp.compute_dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert len(task.losses) == 7 and all(math.isfinite(x) for x in task.losses)
    # the wrappers are gone after fit: the model is the user's again (with its key/value cache back on)
    assert not any("_checkpoint_wrapped_module" in n for n, _ in task.model.named_modules())
    config = getattr(task.model, "config", None)
    assert getattr(config, "use_cache", None) in (None, True) and ckpt._cache_configs == []


@pytest.mark.parametrize("name", NAMES)
def test_torch_compile_counts_flops_once_and_trains(name):
    task = Task(family(name))
    monitor = la.MFUMonitor(window=2, warmup_batches=1, peak_flops=PEAK, print_summary=False)
    compiler = la.TorchCompile(backend="eager")  # dynamo's graph capture without Inductor's codegen: seconds
    fit(task, [monitor, compiler], steps=4)
    assert compiler.fallback_reason is None and compiler.compiled_names
    check_flops(task, monitor)
    assert all(math.isfinite(x) for x in task.losses)


@pytest.mark.parametrize("name", NAMES)
def test_batch_size_tuner_sets_the_batch_and_leaves_no_trace(name):
    task = Task(family(name), batch_size=2)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    tuner = la.BatchSizeTuner(max_batch_size=8, max_probes=3, print_summary=False)
    fit(task, [tuner], steps=0)  # steps=0: only the search runs, then nothing trains
    assert 2 <= tuner.summary["batch_size"] <= 8 and task.batch_size == tuner.summary["batch_size"]
    after = task.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # probes restored parameters and buffers


def test_checkpointing_a_block_class_the_model_lacks_lists_the_ones_it_has():
    gpt2 = family("gpt2")
    llama_block = family("llama").block()
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer matched no submodule of Task.*GPT2Block"):
        fit(Task(gpt2), [la.ActivationCheckpointing(modules=[llama_block])], steps=1)


def test_flops_counted_once_under_checkpointing_with_a_one_batch_warmup():
    fam = family("nanogpt")
    task = Task(fam)
    monitor = la.MFUMonitor(window=2, warmup_batches=2, peak_flops=PEAK, print_summary=False)
    fit(task, [monitor, la.ActivationCheckpointing(modules=[fam.block()])], steps=5)
    check_flops(task, monitor)


@pytest.mark.parametrize("name", ["llama", "gpt2", "litgpt", "nanogpt"])
def test_autopilot_searches_on_the_model_and_trains_on_what_it_kept(name):
    fam = family(name)
    # Hugging Face models as their eager attention: the smell the Autopilot must act on (switch to the library's
    # sdpa); litgpt already runs SDPA, nanoGPT's manual path is rewritten
    model = fam.build("eager") if fam.needs == "transformers" else None
    task = Task(fam, model=model, batch_size=2)
    autopilot = la.Autopilot(
        warmup_steps=2, measure_steps=6, budget_seconds=90, freeze=["compile"], save_plan=False, print_summary=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[autopilot],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task)
    # the table reports what fused and what did not; no warning per block that already calls SDPA
    assert not [w for w in caught if str(w.message).startswith("use_fused_attention")]
    assert autopilot.plan is not None and autopilot.plan.baseline_samples_per_sec > 0
    assert autopilot.records, "nothing was tried"
    broken = [r for r in autopilot.records if r.reason.startswith(("failed", "could not"))]
    assert not broken, broken  # every fix applies to, measures on and reverts from this model
    for record in autopilot.records:
        if record.kept and record.numerics is not None:
            assert record.numerics["ok"], record
    if fam.needs == "transformers" or name == "nanogpt":  # hand-written attention: the fused one is trialled
        fused = [r for r in autopilot.records if r.name == "fused_attention"]
        assert fused and fused[0].numerics is not None and fused[0].numerics["ok"], autopilot.records
        assert fused[0].numerics["grad_cosine"] > 0.999
        if fam.needs == "transformers":  # through the library's own switch, not a rewrite
            assert "attn_implementation" in fused[0].change and "sdpa" in fused[0].change
    if name == "litgpt":  # its attention already calls SDPA (read from its code): not offered, nothing measured
        fused = [r for r in autopilot.records if r.name == "fused_attention"]
        assert all(
            r.samples_per_sec is None and r.numerics is None and "already runs fused" in r.reason for r in fused
        ), fused
    # accumulation 2: the larger micro-batch with the same global batch is tried (before the smells' fixes)
    assert any(r.name == "micro_batch" and r.samples_per_sec is not None for r in autopilot.records), autopilot.records
    # the training after the search: the global batch held (2 x 2), finite losses, the steps all counted
    assert task.batch_size * trainer.accumulate_grad_batches == 4
    assert trainer.global_step == 3 and all(math.isfinite(x) for x in task.losses)
