"""Every built-in intervention through apply -> revert, and through an apply that fails halfway, on a real fit's run:
the training state (weights, module tree, hooks, compiled calls, optimizer flags and state, loader settings and
attributes, accumulation, prefetching, precision plugin, matmul precision, comm-hook mode) is bit-identical after.

"Fails halfway" is injected generically: ``Undo.push`` raises right after its k-th push, for every k the change
makes, i.e. a failure after each part of the change in turn. Activation checkpointing also fails inside the wrap
(the leak of the larger micro-batch this used to cause)."""

from __future__ import annotations

import importlib.util

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks.autopilot.fixes import INTERVENTIONS, SwitchableCompression
from lightning_accel.callbacks.autopilot.fixes.float8 import _has_torchao_float8
from lightning_accel.core.autopilot import Undo
from tests.callbacks.test_autopilot import Attention

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_TORCHAO = _has_torchao_float8()


def _tiny_causal_lm():
    if not HAS_TRANSFORMERS:
        return None
    import transformers

    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=8, n_layer=1, n_head=2))


PARAMS = {
    "dataloader": {"num_workers": 1, "prefetch_factor": 2, "persistent_workers": True},
    "compile": {"backend": "eager"},
    "float8": {"emulate": True, "min_size": 0},  # torchao's emulation: the same module swap on a CPU
}
#: (label, intervention, params): every built-in once, compression in each of its modes
CASES = [(name, name, PARAMS.get(name, {})) for name in INTERVENTIONS if name != "compression"]
#: what cannot run here: nothing for the fused loss to change without a Hugging Face causal LM; no FP8 without torchao
MISSING = {name for name, has in (("fused_cross_entropy", HAS_TRANSFORMERS), ("float8", HAS_TORCHAO)) if not has}
CASES = [case for case in CASES if case[0] not in MISSING]
CASES += [(f"compression:{mode}", "compression", {"compression": mode}) for mode in ("bf16", "fp16", "topk", "qsgd")]


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = Attention(d=16, heads=2, seq=8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        # two input channels: a weight with one is contiguous in both memory formats (channels_last changes nothing)
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.lm = _tiny_causal_lm()  # for fused_cross_entropy (None without transformers)
        self.batch_size, self.num_workers = 4, 0

    def training_step(self, batch, batch_idx):
        (x,) = batch
        x = self.attn(x)
        x = x + self.conv(x.view(-1, 2, 4, 16)).view_as(x)
        for block in self.blocks:
            x = x + block(x)
        loss = x.square().mean()
        if self.lm is not None:
            ids = (x.detach()[..., 0].abs() * 10).long() % 64
            loss = loss + self.lm(input_ids=ids, labels=ids).loss
        return loss

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randn(64, 8, 16)),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=False)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            value.stride(),  # a memory-format change moves no value
            value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"",
        )
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def fingerprint(run) -> dict:
    from lightning_accel._compat import compiled_call

    module, trainer = run.module, run.trainer
    plugin = trainer.precision_plugin
    return _plain(
        {
            "params": dict(module.named_parameters()),
            "buffers": dict(module.named_buffers()),
            "modules": [(n, type(m).__name__) for n, m in module.named_modules()],
            "hooks": [
                (n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                for n, m in module.named_modules()
            ],
            "compiled": [n for n, m in module.named_modules() if compiled_call(m) is not None],
            "patched": [n for n, m in module.named_modules() if "forward" in m.__dict__],
            "optimizers": [
                (
                    {k: v for k, v in o.defaults.items()},
                    [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
                    {i: s for i, s in enumerate(o.state.values())},
                )
                for o in trainer.optimizers
            ],
            "loader": run.source.current(),
            "overrides": dict(run.source._overrides),
            "attributes": (module.batch_size, module.num_workers),
            "config": (run.config.accumulate, run.config.prefetch, run.config.prefetch_depth),
            "plugin": (id(plugin), type(plugin).__name__, plugin.state_dict(), getattr(plugin, "precision", None)),
            "matmul": torch.get_float32_matmul_precision(),
            "checkpoint_io": (type(trainer.strategy.checkpoint_io).__name__, id(trainer.strategy.checkpoint_io)),
            "comm": run.extras["comm_switch"].mode,
            "residuals": {m: r for m, r in run.extras["comm_switch"].residuals().items() if r},
        }
    )


class Sweep(Callback):
    """Runs ``body(run)`` in on_fit_start with the run the Autopilot would build."""

    def __init__(self, body) -> None:
        self.body = body

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning_accel.callbacks._fit.loader_source import TrainLoaderSource
        from lightning_accel.callbacks.autopilot.fit_run import make_run

        run = make_run(trainer, pl_module, TrainLoaderSource(trainer, pl_module), warmup_steps=5)
        run.extras["comm_switch"] = SwitchableCompression()  # as if registered on a DDP model (one process here)
        self.body(run)


def _fit(body, accumulate: int = 4) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        callbacks=[Sweep(body)],
    )
    trainer.fit(Net())


def test_the_micro_batch_jumps_to_one_micro_batch_first_and_falls_back_to_doubling() -> None:
    from lightning_accel.callbacks.autopilot.fixes import MicroBatch

    seen: dict[str, object] = {}

    def body(run) -> None:
        jump = MicroBatch()  # the first offer: 4 x 8 -> 32 x 1
        undo = jump.apply(run)
        seen["jump"] = dict(jump.params)
        undo()  # measured no faster: reverted
        following = jump.fallback()
        seen["refused"] = set(run.extras["micro_batch_refused"])
        following.apply(run)  # kept: 4 x 8 -> 8 x 4
        seen["following"] = dict(following.params)
        again = MicroBatch()  # from 8 x 4 the jump is a new question: asked again
        undo = again.apply(run)
        seen["again"] = dict(again.params)
        undo()  # refused from here too
        doubling = again.fallback()
        doubling.apply(run)  # kept: 8 x 4 -> 16 x 2
        seen["doubling"] = dict(doubling.params)
        last = MicroBatch()  # 16 x 2 -> 32 x 1 (a doubling: accumulation 2)
        undo = last.apply(run)
        seen["last"] = dict(last.params)
        undo()
        seen["last_fallback"] = last.fallback()
        seen["refused_all"] = set(run.extras["micro_batch_refused"])
        seen["unavailable"] = MicroBatch().unavailable(run)

    _fit(body, accumulate=8)
    assert seen["jump"] == {"batch_size": 32, "accumulate_grad_batches": 1}
    assert seen["refused"] == {((4, 8), (32, 1))}
    assert seen["following"] == {"batch_size": 8, "accumulate_grad_batches": 4}
    assert seen["again"] == {"batch_size": 32, "accumulate_grad_batches": 1}
    assert seen["doubling"] == {"batch_size": 16, "accumulate_grad_batches": 2}
    assert seen["last"] == {"batch_size": 32, "accumulate_grad_batches": 1} and seen["last_fallback"] is None
    assert seen["refused_all"] == {((4, 8), (32, 1)), ((8, 4), (32, 1)), ((16, 2), (32, 1))}
    assert "batch_size=32 × accumulate_grad_batches=1 was measured no faster before" in seen["unavailable"]


def test_every_intervention_reverts_bit_identically_after_a_full_and_a_partial_apply(monkeypatch) -> None:
    outcomes: dict[str, list[str]] = {}
    precision_before = torch.get_float32_matmul_precision()

    def body(run) -> None:
        # a real optimizer state, so the sweep also sees it preserved
        run.runner.measure(1, 2)
        for label, name, params in CASES:
            cls = INTERVENTIONS[name]
            before = fingerprint(run)
            change = cls(**params)
            pushes: list[int] = []
            original_push = Undo.push

            def counting(self, step, _pushes=pushes):
                _pushes.append(1)
                original_push(self, step)

            monkeypatch.setattr(Undo, "push", counting)
            undo = change.apply(run)
            monkeypatch.setattr(Undo, "push", original_push)
            assert fingerprint(run) != before, f"{name} changed nothing"
            state = run.extras["comm_switch"].state(run.extras["comm_switch"].mode)
            if state is not None:  # as after a compressed step: a residual the revert must drop
                state.error_dict[0] = torch.ones(3)
                assert fingerprint(run)["residuals"]
            undo()
            assert fingerprint(run) == before, f"{name}: apply -> revert is not bit-identical"
            outcomes[label] = ["full"]
            for k in range(1, len(pushes) + 1):
                count = [0]

                def failing(self, step, _count=count, _k=k):
                    original_push(self, step)
                    _count[0] += 1
                    if _count[0] == _k:
                        raise RuntimeError(f"injected after part {_k}")

                monkeypatch.setattr(Undo, "push", failing)
                with pytest.raises(RuntimeError, match=f"injected after part {k}"):
                    cls(**params).apply(run)
                monkeypatch.setattr(Undo, "push", original_push)
                assert fingerprint(run) == before, f"{name}: failing after part {k} of {len(pushes)} leaked"
                outcomes[label].append(f"fail@{k}")

    _fit(body)
    assert set(outcomes) == {label for label, _, _ in CASES}
    assert {name for _, name, _ in CASES} | MISSING == set(INTERVENTIONS)
    assert all(len(v) >= 2 for v in outcomes.values()), outcomes  # every change has at least one part to fail after
    assert torch.get_float32_matmul_precision() == precision_before


def test_activation_checkpointing_failing_inside_the_wrap_leaves_the_micro_batch_alone(monkeypatch) -> None:
    import lightning_accel.core.checkpointing as checkpointing

    seen = {}
    real = checkpointing.apply_activation_checkpointing

    def wraps_one_then_raises(model, targets):
        real(model.blocks[0], [nn.Tanh])  # a wrapper is in place ...
        raise RuntimeError("checkpoint wrapper unavailable")

    def body(run) -> None:
        before = fingerprint(run)
        monkeypatch.setattr(checkpointing, "apply_activation_checkpointing", wraps_one_then_raises)
        with pytest.raises(RuntimeError, match="checkpoint wrapper unavailable"):
            INTERVENTIONS["activation_checkpointing"]().apply(run)
        monkeypatch.setattr(checkpointing, "apply_activation_checkpointing", real)
        seen["after"] = fingerprint(run) == before
        seen["micro"] = (run.source.current()["batch_size"], run.config.accumulate)

    _fit(body)
    assert seen == {"after": True, "micro": (4, 4)}


def test_compression_mode_comes_from_the_scaling_projection() -> None:
    from lightning_accel.callbacks.autopilot.fixes import choose_compression

    # a 125 M-parameter model, 10 ms steps: Top-K's all-gather pays on a slow link with few ranks ...
    mode, why = choose_compression(n=2, link="25gbe", params=125_000_000, step_s=0.01)
    assert mode == "topk" and "bf16" in why and "qsgd" in why and "2 ranks" in why
    # ... not on NVLink, and not with many ranks (the gathered bytes grow with their number)
    assert choose_compression(n=2, link="nvlink", params=125_000_000, step_s=0.01)[0] == "bf16"
    assert choose_compression(n=64, link="25gbe", params=125_000_000, step_s=0.01)[0] == "bf16"
    # a long step hides every all-reduce: no hook is 5 % ahead of bf16
    assert choose_compression(n=2, link="25gbe", params=125_000_000, step_s=10.0)[0] == "bf16"


def test_compression_names_the_matching_strategy_string_and_refuses_bad_modes() -> None:
    from lightning_accel.callbacks.autopilot.fixes import Compression

    for mode, name in (("topk", "ddp_topk"), ("qsgd", "ddp_qsgd"), ("bf16", "ddp_bf16_compress")):
        change = Compression(compression=mode)
        keys, python = change.config(None)
        assert keys == [("trainer.strategy", name)] and repr(name) in python[0]
        assert change.describe(None) == f"strategy={name!r}"
    with pytest.raises(ValueError, match="compression='int8'.*topk"):
        Compression(compression="int8")
    with pytest.raises(ValueError, match="unknown interconnect 'wifi'"):
        Compression(interconnect="wifi")


def test_a_projected_topk_falls_back_to_bf16_and_a_replayed_mode_does_not() -> None:
    from lightning_accel.callbacks.autopilot.fixes import Compression

    chosen = Compression()
    chosen.params, chosen.why = {"compression": "topk"}, "projected step (ms) ..."  # as _choose leaves it
    following = chosen.fallback()
    assert isinstance(following, Compression) and following.params == {"compression": "bf16"}
    assert following.fallback() is None
    assert Compression(compression="topk").fallback() is None  # a plan's mode is replayed as it is


def test_the_worker_search_skips_counts_that_cannot_feed_the_step_from_the_measured_load_time() -> None:
    from lightning_accel.callbacks.autopilot.windows import Window
    from lightning_accel.core.autopilot.budget import feasible_worker_counts

    # 10 steps of 33 ms, 24 ms of each the main process loading its batch: the step consumes 1 / 9 ms = 111 batches/s
    window = Window(samples=160, seconds=0.33, steps=10, stage_seconds={"data": 0.24, "forward": 0.09})
    consumption = 1 / 0.009
    # one worker loads at most 2 x 41.7 = 83 batches/s: not measured; two (167) and four may feed
    assert feasible_worker_counts([1, 2, 4], window, 1, consumption, 0) == [2, 4]
    # a step too fast for any count: the largest is still measured
    assert feasible_worker_counts([1, 2], window, 1, 1000.0, 0) == [2]
    # accumulation: the data wait per optimizer step is spread over its micro-batches (4 x 6 ms): one worker loads
    # up to 333 batches/s and may feed 200
    assert feasible_worker_counts([1, 2], window, 4, 200.0, 0) == [1, 2]
    # a loader that has workers already: its data wait is no load time, every count is measured
    assert feasible_worker_counts([2, 4], window, 1, consumption, 1) == [2, 4]


def test_the_worker_search_is_costed_from_the_measured_load_time() -> None:
    from types import SimpleNamespace

    from lightning_accel.callbacks.autopilot.fixes import DataLoaderSettings
    from lightning_accel.callbacks.autopilot.windows import Window
    from lightning_accel.core.autopilot.budget import WORKER_START_SECONDS, worker_search_seconds

    # 24 ms a batch in the main process, a step consuming 111 batches/s: 2 workers load 83/s, neither setting feeds,
    # both are measured once: their workers' start, then 23 batches + the queue, two at a time
    expected = sum(2 * WORKER_START_SECONDS + (23 + 2 * pf) * 0.024 / 2 for pf in (2, 4))
    assert worker_search_seconds([(2, 2), (2, 4)], 0.024, 1 / 0.009, 2) == pytest.approx(expected)
    # 5 ms a batch: one worker (200/s) feeds 111/s with the 20 % margin: measured twice, and the walk ends there
    assert worker_search_seconds([(1, 2), (1, 4), (2, 2)], 0.005, 1 / 0.009, 2) == pytest.approx(
        2 * (WORKER_START_SECONDS + 25 * 0.005)
    )

    window = Window(samples=160, seconds=0.33, steps=10, stage_seconds={"data": 0.24, "forward": 0.09})
    source = SimpleNamespace(current=lambda: {"num_workers": 0, "pin_memory": False})
    run = SimpleNamespace(
        current=window,
        baseline=window,
        source=source,
        config=SimpleNamespace(accumulate=1),
        trainer=SimpleNamespace(num_devices=1),
    )
    cost = DataLoaderSettings().setup_seconds(run)
    assert cost > 1.0  # the grid this rank's cores allow, from 24 ms a batch: a second or more of the trial
    assert DataLoaderSettings(num_workers=2, prefetch_factor=4).setup_seconds(run) == 0.0  # a replayed setting
    source.current = lambda: {"num_workers": 1, "pin_memory": False}
    assert DataLoaderSettings().setup_seconds(run) == 0.0  # its data wait is no load time


def _conv_run(device: str = "cuda", world_size: int = 1):
    from types import SimpleNamespace

    from lightning_accel.callbacks.autopilot.fixes import Run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.LazyLinear(4))
    model(torch.randn(1, 3, 8, 8))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), world_size=world_size)
    return Run(trainer=trainer, module=model, source=None, config=None, runner=None)  # type: ignore[arg-type]


def test_channels_last_converts_the_nchw_convolutions_and_its_undo_returns_exactly_those() -> None:
    from lightning_accel.callbacks.autopilot.fixes import ChannelsLast

    run = _conv_run()
    model = run.module
    # a weight the user already converted is neither converted nor returned to NCHW by the undo
    model[2].weight.data = model[2].weight.data.contiguous(memory_format=torch.channels_last)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    fix = ChannelsLast()
    assert fix.unavailable(run) is None
    undo = fix.apply(run)
    assert fix.params == {"modules": ["0"]}
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert list(model.parameters()) == params  # the same Parameter objects: the optimizer still holds them
    model(torch.randn(2, 3, 8, 8)).sum().backward()  # trains in the new format
    undo()
    assert model[0].weight.is_contiguous() and model[2].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert "model.to(memory_format=torch.channels_last)" in fix.config(run)[1][0]


def test_channels_last_is_offered_on_one_cuda_process_with_an_nchw_convolution_only() -> None:
    from lightning_accel.callbacks.autopilot.fixes import ChannelsLast

    assert "on cpu" in ChannelsLast().unavailable(_conv_run("cpu"))
    assert "under DDP" in ChannelsLast().unavailable(_conv_run(world_size=2))
    run = _conv_run()
    run.module.to(memory_format=torch.channels_last)
    assert "no 2-D convolution" in ChannelsLast().unavailable(run)
    with pytest.raises(ValueError, match=r"modules=\['nope'\].*omit modules="):
        ChannelsLast(modules=["nope"]).apply(_conv_run())
