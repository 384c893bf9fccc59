"""The stage planner, the schedule checks, the recognised structures and the argument errors of ``pp``, in one
process (no process group)."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel.core.pipeline_plan import bubble_fraction, check_schedule, plan_stages
from lightning_accel.demo.model import GPT, GPTConfig
from lightning_accel.strategies.pipeline import (
    PipelineLayout,
    PipelineStrategy,
    _Stage,
    _UserLayout,
    default_pipeline_batch,
    find_layout,
)
from lightning_accel.strategies.pipeline_checks import reference_precision
from lightning_accel.strategies.pipeline_split import check_split, sample_batch


def test_blocks_are_balanced_with_the_embedding_on_the_first_stage_and_the_head_on_the_last():
    plan = plan_stages([1.0] * 4, 2)
    assert [list(r) for r in plan.blocks] == [[0, 1], [2, 3]] and plan.ranks == (0, 1)
    # a heavy embedding: the first stage gets fewer blocks (max cost 3 instead of 4)
    plan = plan_stages([1.0] * 4, 2, first_cost=2.0)
    assert [list(r) for r in plan.blocks] == [[0], [1, 2, 3]] and plan.costs == (3.0, 3.0)
    plan = plan_stages([1.0] * 6, 3, last_cost=2.0)
    assert [len(r) for r in plan.blocks] == [3, 2, 1] or max(plan.costs) == 3.0
    assert max(plan.costs) == 3.0
    # looped placement for two stages per rank
    assert plan_stages([1.0] * 4, 4, pipeline_ranks=2).ranks == (0, 1, 0, 1)
    assert plan_stages([1.0] * 4, 2, blocks_per_stage=[3, 1]).blocks == (range(0, 3), range(3, 4))
    assert "stage 0 (rank 0): blocks 0-1 + embedding" in plan_stages([1.0] * 4, 2).describe()


def test_planner_errors_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"stages=5 but the model has 4 repeated blocks.*stages <= 4"):
        plan_stages([1.0] * 4, 5)
    with pytest.raises(ValueError, match=r"blocks_per_stage=\[2, 1\] must give 2 positive block counts"):
        plan_stages([1.0] * 4, 2, blocks_per_stage=[2, 1])


def test_schedule_checks():
    check_schedule("1f1b", num_stages=2, pipeline_ranks=2, microbatches=2)
    check_schedule("interleaved_1f1b", num_stages=4, pipeline_ranks=2, microbatches=4)
    with pytest.raises(ValueError, match=r"schedule='nope': use one of gpipe, 1f1b, interleaved_1f1b"):
        check_schedule("nope", num_stages=2, pipeline_ranks=2, microbatches=2)
    with pytest.raises(ValueError, match=r"runs several stages per rank.*give stages=4"):
        check_schedule("interleaved_1f1b", num_stages=2, pipeline_ranks=2, microbatches=4)
    with pytest.raises(ValueError, match=r"needs microbatches >= the 4 pipeline ranks \(got microbatches=2\)"):
        check_schedule("1f1b", num_stages=4, pipeline_ranks=4, microbatches=2)
    with pytest.raises(ValueError, match=r"runs one stage per rank.*schedule='interleaved_1f1b'"):
        check_schedule("gpipe", num_stages=4, pipeline_ranks=2, microbatches=2)
    check_schedule("gpipe", num_stages=4, pipeline_ranks=4, microbatches=1)  # GPipe runs any m


def test_bubble_fraction():
    assert bubble_fraction(2, 1) == pytest.approx(1 / 2)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4, stages_per_rank=2) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 4) == 0.0


def _strategy() -> PipelineStrategy:
    return PipelineStrategy(print_plan=False)


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    models: dict[str, nn.Module] = {"demo": GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16))}
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        models["llama"] = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=32,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=32,
            )
        )
        models["gpt2"] = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    except ImportError:
        pass
    try:
        from litgpt import GPT as LitGPT
        from litgpt import Config

        models["litgpt"] = LitGPT(
            Config(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=32, padded_vocab_size=32)
        )
    except ImportError:
        pass
    return models


@pytest.mark.parametrize("kind", ["demo", "llama", "gpt2", "litgpt"])
def test_recognised_structures_reproduce_the_forward_stage_by_stage(kind):
    models = _models()
    if kind not in models:
        pytest.skip(f"{kind} needs its library (transformers / litgpt)")
    net = models[kind].eval()
    layout = find_layout(net)
    check_split(layout)  # the composed forward equals the model's own
    first = _Stage(layout, range(0, 1), first=True, last=False)
    last = _Stage(layout, range(1, 2), first=False, last=True)
    ids = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        want = net(ids)
        got = last(first(ids))
    want = want if isinstance(want, torch.Tensor) else want.logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # each stage holds only its part (by identity: the stages share the network's tensors): the first the
    # embedding and block 0, the last block 1, the norm and the head; together every parameter of the network
    def ids(module):
        return {id(p) for p in module.parameters()}

    blocks = layout.block_list()
    embedding = set().union(*(ids(net.get_submodule(p)) for p in layout.first))
    head = set().union(*(ids(net.get_submodule(p)) for p in layout.last))
    assert ids(first) == ids(blocks[0]) | embedding and not ids(blocks[1]) & ids(first)
    assert ids(last) == ids(blocks[1]) | head and not ids(blocks[0]) & ids(last)
    assert ids(first) | ids(last) == ids(net)


def test_a_structure_it_cannot_split_is_refused_with_what_to_give_instead():
    with pytest.raises(ValueError, match=r"cannot split Sequential: no recognised structure.*pipeline_layout"):
        find_layout(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))

    class Scaled(GPT):  # a forward that does more than embed -> blocks -> head
        def forward(self, idx):
            return 2 * super().forward(idx)

    layout = find_layout(Scaled(GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16)))
    with pytest.raises(ValueError, match=r"does not reproduce its own forward.*pipeline_layout"):
        check_split(layout)


def test_a_user_layout_describes_an_unrecognised_model():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.body = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            x = self.inp(x)
            for b in self.body:
                x = b(x)
            return self.out(x)

    net = Net()
    layout = _UserLayout(net, PipelineLayout(embed=net.inp, blocks=net.body, head=net.out))
    assert layout.first == ["inp"] and layout.blocks == "body" and layout.last == ["out"]
    x = torch.randn(2, 4)
    stages = [_Stage(layout, range(0, 2), first=True, last=False), _Stage(layout, range(2, 3), first=False, last=True)]
    torch.testing.assert_close(stages[1](stages[0](x)), net(x))
    with pytest.raises(ValueError, match="must each be a submodule of the network"):
        _UserLayout(net, PipelineLayout(embed=nn.Linear(1, 1), blocks=net.body, head=net.out))


def test_batches_become_inputs_and_targets():
    ids = torch.arange(6).view(2, 3)
    x, y = default_pipeline_batch((ids,))
    assert torch.equal(x, ids) and y.tolist() == [[1, 2, -100], [4, 5, -100]]  # shifted like labels=ids
    assert default_pipeline_batch({"input_ids": ids})[1].tolist() == y.tolist()
    a, b = default_pipeline_batch((ids, ids + 1))
    assert torch.equal(b, ids + 1)
    with pytest.raises(ValueError, match="pipeline_batch"):
        default_pipeline_batch([ids, ids, ids])


def test_argument_errors():
    with pytest.raises(ValueError, match=r"schedule='zb'"):
        PipelineStrategy(schedule="zb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"microbatches=0\) must be an integer >= 1"):
        PipelineStrategy(microbatches=0)
    with pytest.raises(ValueError, match=r"pipeline_size=3 × data_parallel_size=1 does not fit 4 processes"):
        PipelineStrategy(pipeline_size=3).resolve_sizes(4)
    assert PipelineStrategy(data_parallel_size="auto").resolve_sizes(4) == (2, 2)
    with pytest.raises(ValueError, match=r"compression='powersgd'\): use one of 'fp16', 'bf16', 'topk', 'qsgd'"):
        PipelineStrategy(compression="powersgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"density=0\) must be a fraction in \(0, 1\]"):
        PipelineStrategy(compression="topk", density=0)
    with pytest.raises(ValueError, match=r"levels=200\) must be an integer in 1..127"):
        PipelineStrategy(compression="qsgd", levels=200)
    with pytest.raises(
        ValueError,
        match=r"compression='bf16' compresses the all-reduce over data-parallel .*1 "
        r"replica per stage.*strategy='pp_ddp'",
    ):
        PipelineStrategy(compression="bf16").resolve_sizes(2)
    assert PipelineStrategy(compression="bf16", data_parallel_size="auto").resolve_sizes(4) == (2, 2)
    assert PipelineStrategy().resolve_sizes(4) == (4, 1)


def test_strings_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_accel  # noqa: F401

    assert "pp" in StrategyRegistry and "pp_ddp" in StrategyRegistry
    assert StrategyRegistry.get("pp_ddp")._dp_arg == "auto"


def test_pp_fsdp2_is_refused_with_the_reason_and_what_to_use():
    import lightning_accel  # noqa: F401

    with pytest.raises(ValueError, match=r"strategy='pp_fsdp2' is not built: .*fully_shard.*Use strategy='pp_ddp'"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="pp_fsdp2", logger=False)


def test_the_bubble_finding_compares_with_the_formula_and_names_the_fix():
    from lightning_accel.core.pipeline_plan import bubble_finding

    assert bubble_finding([0.1, 0.12], pipeline_ranks=2, microbatches=8) is None  # under the threshold
    f = bubble_finding([0.36, 0.29], pipeline_ranks=2, microbatches=4)
    assert f is not None and f.rule == "pipeline_bubble" and f.value == pytest.approx(0.36)
    assert "rank 0: 36%, rank 1: 29%" in f.evidence and "= 20% for P=2 ranks, m=4" in f.evidence
    assert "microbatches=8) (bubble 11%" in f.fix and "stages=4 (bubble 11%)" in f.fix
    assert "balance the stages" in f.fix  # 36% is well above the formula's 20%
    g = bubble_finding([0.5, None], pipeline_ranks=2, microbatches=1, stages_per_rank=1, schedule="gpipe")
    assert g is not None and "rank 1: ?" in g.evidence and "balance" not in g.fix


def test_the_scaling_model_projects_pp_x_tp_x_dp_with_the_bubble_and_point_to_point_bytes():
    from lightning_accel.core.scaling import ScalingWorkload, get_interconnect, project_scaling

    w = ScalingWorkload(
        compute_s=8.0,
        params=10**9,
        grad_bytes=2,
        n_layers=32,
        hidden_size=4096,
        tokens_per_step=32768,
        activation_bytes=2,
    )
    link = get_interconnect("infiniband_ndr")
    (pp,) = project_scaling(w, link, n=[64], strategies=["pp"], tp_size=8, pp_size=4, microbatches=16)
    assert (pp.pp_size, pp.tp_size) == (4, 8)
    slot = 8.0 / (8 * 4 * 16)
    assert pp.bubble_s == pytest.approx(3 * slot)  # (P-1) idle slots of one micro-batch's stage compute
    act = 32768 / 16 * 4096 * 2  # one micro-batch's activations cross each stage boundary, forward and backward
    assert pp.p2p_s == pytest.approx((16 + 3) * 2 * (link.latency + act / link.bandwidth))
    assert pp.efficiency < 16 / 19  # never better than the bubble allows: m / (m + P - 1)
    more = project_scaling(w, link, n=[64], strategies=["pp"], tp_size=8, pp_size=4, microbatches=64)[0]
    assert more.efficiency > pp.efficiency  # more micro-batches: a smaller bubble
    with pytest.raises(ValueError, match=r"pp_size=4 x tp_size=8 does not divide n=48"):
        project_scaling(w, link, n=[48], strategies=["pp"], tp_size=8, pp_size=4)


class _Tiny(pl.LightningModule):  # a module the split would accept: the refusals come before it is looked at
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16))

    def training_step(self, batch, i):
        raise AssertionError("the refusal comes before the first step")

    def train_dataloader(self):
        ids = torch.randint(0, 32, (4, 9))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(**kwargs):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=PipelineStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(_Tiny())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gradient_clip_val": 1.0}, r"gradient_clip_val=1.0 clips by the norm.*gradient_clip_algorithm='value'"),
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"}, r"clips by the norm"),
    ],
)
def test_clipping_by_the_norm_is_refused_before_the_process_group(kwargs, match):
    import torch.distributed as dist

    with pytest.raises(ValueError, match=match):
        _fit(**kwargs)
    assert not dist.is_initialized()  # refused in setup_environment, before anything started


def test_a_gradient_scaler_is_refused_before_the_process_group():
    import torch.distributed as dist
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"gradient scaler \(16-mixed\) is not supported.*bf16-mixed"):
        _fit(plugins=[plugin])
    assert not dist.is_initialized()


def test_balance_by_time_measures_every_block_and_leaves_the_model_as_it_was():
    from lightning_accel.strategies.pipeline import measure_stage_costs

    net = GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=3, n_head=2, d_model=16))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.eval()
    first, blocks, last = measure_stage_costs(find_layout(net), torch.device("cpu"), shape=(2, 8), reps=2)
    assert len(blocks) == 3 and min(blocks) > 0 and first > 0 and last > 0
    assert not net.training  # the mode restored
    for n, p in net.named_parameters():
        assert p.grad is None and torch.equal(p, before[n]) and p.device.type == "cpu", n


def test_balance_by_time_plans_with_the_measured_costs(monkeypatch):
    import lightning_accel.strategies.pipeline_split as pipeline_split

    class Task(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=4, n_head=2, d_model=16))

    # the last block measured 5x slower than the others: 3 blocks on stage 0, the slow one alone on stage 1
    monkeypatch.setattr(
        pipeline_split, "measure_stage_costs", lambda layout, device, **probe: (0.0, [1.0, 1.0, 1.0, 5.0], 0.0)
    )
    strategy = PipelineStrategy(balance="time", print_plan=False)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.pp_size = 2
    strategy._split(Task())
    assert [list(r) for r in strategy.plan.blocks] == [[0, 1, 2], [3]] and strategy.plan.unit == "µs fwd+bwd"
    by_params = PipelineStrategy(print_plan=False)
    by_params.pp_size = 2
    by_params._split(Task())
    assert [list(r) for r in by_params.plan.blocks] == [[0, 1], [2, 3]]  # the default: by parameter count
    with pytest.raises(ValueError, match=r"balance='speed'\): use 'parameters' \(the default\) or 'time'"):
        PipelineStrategy(balance="speed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"balance_shape=\(2,\)\) must be \(batch, sequence length\)"):
        PipelineStrategy(balance="time", balance_shape=(2,))  # type: ignore[arg-type]


def _strategy(**kwargs):
    strategy = PipelineStrategy(print_plan=False, **kwargs)
    strategy.pp_size = 2
    return strategy


def _gpt():
    return GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=4, n_head=2, d_model=16))


def test_a_module_the_split_cannot_place_is_refused_naming_what_to_change():
    class TwoNets(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.critic = _gpt(), nn.Linear(4, 4)

    with pytest.raises(
        ValueError,
        match=r"TwoNets has 2 child modules with parameters \(model, critic\).*"
        r"PipelineStrategy\(network='attr'\)",
    ):
        _strategy()._split(TwoNets())
    with pytest.raises(ValueError, match=r"network='net' is not a module attribute of TwoNets"):
        _strategy(network="net")._split(TwoNets())
    strategy = _strategy(network="model")
    strategy._split(TwoNets())  # named: the other child is left alone
    assert [list(r) for r in strategy.plan.blocks] == [[0, 1], [2, 3]]

    class OwnParameter(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _gpt()
            self.scale = nn.Parameter(torch.ones(()))

    with pytest.raises(ValueError, match=r"OwnParameter registers parameters directly.*move them into the network"):
        _strategy()._split(OwnParameter())

    class Stray(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _gpt()
            self.model.temperature = nn.Parameter(torch.ones(()))  # not in the embedding, a block or the head

    with pytest.raises(
        ValueError,
        match=r"parameters outside the embedding, the blocks and the head.*"
        r"model\.temperature.*pipeline_layout",
    ):
        _strategy()._split(Stray())


def test_resuming_a_checkpoint_of_other_sizes_is_refused_with_the_sizes():
    strategy = _strategy()
    with pytest.raises(ValueError, match=r"not written by a pp Trainer.*load its state_dict"):
        strategy.load_optimizer_state_dict({"optimizer_states": []})
    with pytest.raises(ValueError, match=r"written with 4 pipeline ranks and 4 stages, this run has 2.*same sizes"):
        strategy.load_optimizer_state_dict({"pipeline": {"pipeline_ranks": 4, "stages": 4}, "optimizer_states": []})


def test_no_compute_measured_is_no_bubble_not_a_full_one():
    from lightning_accel.strategies.pipeline import PipelineStats

    stats = PipelineStats(step_s=[0.1, 0.1, 0.1], compute_s=[0.05, 0.06, 0.04])
    assert stats.bubble() == pytest.approx(0.5)
    # the wrapped stage methods never ran (a torch that renamed them): not measured, never read as 100 %
    assert PipelineStats(step_s=[0.1, 0.1, 0.1], compute_s=[0.0, 0.0, 0.0]).bubble() is None
    assert PipelineStats(step_s=[0.1, 0.1], compute_s=[0.05, 0.05], timed=False).bubble() is None


class _FakeStage:
    def __init__(self, names):
        for name in names:
            setattr(self, name, lambda *a, **k: "ran")


def test_the_stage_timer_flags_a_stage_without_the_methods_it_wraps():
    strategy = _strategy()
    strategy._timer.wrap(_FakeStage(["forward_one_chunk", "backward_one_chunk"]))
    assert strategy.stats.timed
    strategy._timer.wrap(_FakeStage(["forward_chunk_renamed"]))
    assert not strategy.stats.timed


class _FakeEvent:
    """A CUDA event on a fake clock: record() reads it, elapsed_time() in milliseconds."""

    clock = [0.0]

    def __init__(self, enable_timing=True):
        self.t = None
        self.synced = False

    def record(self):
        self.t = _FakeEvent.clock[0]

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_on_cuda_the_bubble_is_timed_with_events_read_only_when_asked(monkeypatch):
    from lightning_accel.strategies.pipeline import PipelineStats

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    strategy = _strategy()
    stage = _FakeStage(["forward_one_chunk", "backward_one_chunk"])

    def compute(*args, **kwargs):  # 30 ms of kernels per call on the stream's clock
        _FakeEvent.clock[0] += 0.030

    stage.forward_one_chunk = stage.backward_one_chunk = compute
    strategy._timer.wrap(stage)
    stats = strategy._timer.stats = PipelineStats(pipeline_ranks=2, microbatches=1)
    for _ in range(3):  # a step: 40 ms waiting for the other stage, one forward and one backward
        strategy._timer._chunk_events = []
        begin, end = _FakeEvent(), _FakeEvent()
        begin.record()
        _FakeEvent.clock[0] += 0.040
        stage.forward_one_chunk()
        stage.backward_one_chunk()
        end.record()
        stats.pending.append((begin, end, strategy._timer._chunk_events))
    assert stats.step_s == [] and len(stats.pending) == 3  # nothing read, nothing synchronised, during the steps
    assert stats.bubble(skip=0) == pytest.approx(0.4)
    assert stats.pending == [] and stats.step_s == pytest.approx([0.1] * 3)
    assert stats.compute_s == pytest.approx([0.06] * 3)


def _failing_strategy(error):
    from types import SimpleNamespace

    strategy = _strategy()

    def step(*args, **kwargs):
        raise error

    strategy._runner._schedule = SimpleNamespace(step=step, eval=step)
    strategy._runner._stages = [SimpleNamespace(stage_index=1, is_first=False, is_last=False)]
    return strategy


def test_an_error_of_this_ranks_stage_keeps_its_type_and_message_first():
    class ShapeError(ValueError):
        pass

    strategy = _failing_strategy(ShapeError("mat1 and mat2 shapes cannot be multiplied (4x7 and 8x8)"))
    with pytest.raises(ShapeError) as caught:
        strategy._runner.run(torch.zeros(1), torch.zeros(1), train=True)
    assert str(caught.value).startswith("mat1 and mat2 shapes")
    assert "stopped answering" not in str(caught.value)
    assert any("raised on pipeline rank 0 (stage 1 of ?) inside the 1f1b schedule" in n for n in caught.value.__notes__)


@pytest.mark.parametrize(
    "message",
    [
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms",
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer",
    ],
)
def test_a_peer_that_stopped_answering_is_named_as_such(message):
    strategy = _failing_strategy(RuntimeError(message))
    with pytest.raises(
        RuntimeError, match=r"pipeline rank 0 \(stage 1 of \?\).*stopped answering.*" + re.escape(message[:20])
    ):
        strategy._runner.run(torch.zeros(1), torch.zeros(1), train=True)


# --------------------------------------------------------------------------------------- float inputs, precision
class _FloatNet(nn.Module):  # float features: an nn.Linear embedding, an MLP trunk, a head
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.trunk = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.trunk:
            h = block(h)
        return self.head(h)


class _FloatTask(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = _FloatNet()

    def pipeline_layout(self):
        return PipelineLayout(embed=self.net.embed, blocks=self.net.trunk, head=self.net.head)

    def pipeline_loss(self, out, y):
        return nn.functional.mse_loss(out, y)


def test_the_split_of_a_float_network_is_checked_on_its_own_batch():
    task = _FloatTask()
    layout = _UserLayout(task.net, task.pipeline_layout())
    x = torch.randn(8, 6)
    check_split(layout, x)  # float features in: the composed forward equals the network's own
    # without a batch there is nothing a Linear embedding can be checked on (token ids would not fit it)
    with pytest.raises(ValueError, match=r"no batch to check the split of _FloatNet on.*\(Linear\).*train_dataloader"):
        check_split(layout)

    class Doubled(_FloatNet):  # a forward that does more than embed -> trunk -> head, seen on the float batch
        def forward(self, x):
            return 2 * super().forward(x)

    net = Doubled()
    with pytest.raises(ValueError, match=r"does not reproduce its own forward"):
        check_split(_UserLayout(net, PipelineLayout(embed=net.embed, blocks=net.trunk, head=net.head)), x)


def test_the_stage_cost_probe_times_a_micro_batch_of_the_modules_own_batch(monkeypatch):
    import lightning_accel.strategies.pipeline_split as pipeline_split
    from lightning_accel.strategies.pipeline import measure_stage_costs

    task = _FloatTask()
    layout = _UserLayout(task.net, task.pipeline_layout())
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    first, blocks, last = measure_stage_costs(
        layout, torch.device("cpu"), inputs=x, targets=y, loss=task.pipeline_loss, reps=2
    )
    assert len(blocks) == 4 and min(blocks) > 0 and first > 0 and last > 0
    assert all(p.grad is None for p in task.parameters())
    with pytest.raises(ValueError, match=r"first piece \(Linear\) does not take token ids; pass inputs= and targets="):
        measure_stage_costs(layout, torch.device("cpu"))

    # balance="time" hands the probe one micro-batch of the first batch and the module's own loss
    seen = {}

    def probe(layout, device, **kwargs):
        seen.update(kwargs)
        return 0.0, [1.0, 1.0, 1.0, 3.0], 0.0

    monkeypatch.setattr(pipeline_split, "measure_stage_costs", probe)
    strategy = _strategy(balance="time", microbatches=4)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._lightning_module = task
    sample = (torch.randn(8, 6), torch.randn(8, 3))
    strategy._split(task, sample)
    assert torch.equal(seen["inputs"], sample[0][:2]) and torch.equal(seen["targets"], sample[1][:2])
    assert seen["loss"] == strategy._user_loss and "shape" not in seen
    assert [list(r) for r in strategy.plan.blocks] == [[0, 1, 2], [3]]
    assert strategy._user_loss(torch.ones(2, 3), torch.zeros(2, 3)).item() == 1.0  # the module's mse_loss
    # an explicit balance_shape measures synthetic token ids of that shape instead
    seen.clear()
    strategy = _strategy(balance="time", balance_shape=(2, 16))
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._timed_costs(find_layout(_gpt()), sample)
    assert seen == {"shape": (2, 16)}


@pytest.mark.parametrize(
    ("dtype", "relative", "ok"),
    [
        (torch.float32, 5e-5, True),
        (torch.float32, 4e-3, False),  # one bf16 rounding step: far outside fp32's arithmetic
        (torch.bfloat16, 4e-3, True),  # ... and inside bf16's (8 significant bits)
        (torch.bfloat16, 1e-2, True),
        (torch.bfloat16, 5e-2, False),  # a different loss, not rounding
        (torch.float16, 2e-3, True),
        (torch.float16, 2e-2, False),
    ],
)
def test_the_first_batch_tolerance_is_the_dtypes(dtype, relative, ok):
    strategy, own = _strategy(), 2.0
    piped = own * (1 + relative)
    if ok:
        strategy._loss_check.compare(_FloatTask(), piped, own, dtype)
    else:
        with pytest.raises(
            ValueError, match=r"differs from _FloatTask.training_step's \(2\) by more than .*computed in"
        ):
            strategy._loss_check.compare(_FloatTask(), piped, own, dtype)
    assert strategy.loss_check["dtype"] == str(dtype) and strategy.loss_check["pipeline"] == piped


def test_the_reference_runs_in_the_pipelines_precision():
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = _strategy()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    autocast, dtype = reference_precision(strategy.precision_plugin, _FloatTask())
    assert dtype == torch.bfloat16
    with autocast:
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    strategy = _strategy()
    task = _FloatTask().to(torch.bfloat16)  # bf16-true: the parameters' dtype, no autocast added
    autocast, dtype = reference_precision(strategy.precision_plugin, task)
    assert dtype == torch.bfloat16
    with autocast:
        assert not torch.is_autocast_enabled("cpu")


def test_an_old_pp_ddp_checkpoint_without_compression_state_loads_with_a_warning(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, "pipeline": {"pipeline_ranks": 2, "stages": 2}}, path)
    strategy = PipelineStrategy(compression="topk", density=0.1, data_parallel_size="auto", print_plan=False)
    with pytest.warns(UserWarning, match=r"holds no compression state.*restarts from zero.*differs from an uninterr"):
        checkpoint = strategy.load_checkpoint(path)
    assert checkpoint["pipeline"]["stages"] == 2 and strategy._reducer._saved is None
    saved = {"compression": "topk", "comm_stats": {}}
    torch.save({"state_dict": {}, "lightning_accel_ddp_compression": saved}, path)
    strategy.load_checkpoint(path)
    assert strategy._reducer._saved == saved  # kept until the first exchange makes the compressor


# ------------------------------------------------------------------------------ the structure, found by its forward
class _RenamedGPT(nn.Module):
    """nanoGPT's structure under names the attribute hints do not know: tok, where, layers, final, out."""

    def __init__(self, order=None, tied=True):
        super().__init__()
        cfg = GPTConfig(vocab_size=32, seq_len=16, n_layer=4, n_head=2, d_model=16)
        from lightning_accel.demo.model import Block

        self.tok = nn.Embedding(32, 16)
        self.where = nn.Embedding(16, 16)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(4))
        self.final = nn.LayerNorm(16)
        self.out = nn.Linear(16, 32, bias=False)
        if tied:
            self.out.weight = self.tok.weight
        self.order = order or [0, 1, 2, 3]

    def forward(self, idx):
        x = self.tok(idx) + self.where(torch.arange(idx.shape[1]))
        for i in self.order:
            x = self.layers[i](x)
        return self.out(self.final(x))


class _Wrapped(nn.Module):  # the pieces one level down, in a ModuleDict, and the head on the network
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleDict(
            {
                "emb": nn.Embedding(32, 16),
                "dropped": nn.Dropout(0.1),
                "stack": nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)),
                "post": nn.LayerNorm(16),
            }
        )
        self.proj = nn.Linear(16, 32)

    def forward(self, idx):
        x = self.body["dropped"](self.body["emb"](idx))
        for block in self.body["stack"]:
            x = block(x)
        return self.proj(self.body["post"](x))


def _assert_splits(net, x, first, blocks, last):
    layout = find_layout(net, x)
    assert (layout.first, layout.blocks, layout.last) == (first, blocks, last), layout.name
    check_split(layout, x)
    n = len(layout.block_list())
    stages = [_Stage(layout, range(0, 1), first=True, last=False), _Stage(layout, range(1, n), first=False, last=True)]
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](x)), net(x), rtol=1e-5, atol=1e-5)
    return layout


def test_the_structure_is_found_by_type_and_by_its_forward_whatever_the_names():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    layout = _assert_splits(_RenamedGPT(), ids, ["tok", "where"], "layers", ["final", "out"])
    assert "tok → 4 blocks (layers) → final → out, found by its forward" == layout.name
    _assert_splits(_Wrapped(), ids, ["body.emb"], "body.stack", ["body.post", "proj"])
    assert find_layout(_Wrapped(), ids).drop == "body.dropped"
    # float features: the stem is the module the forward calls on the input itself
    x = torch.randn(2, 6)
    _assert_splits(_FloatNet(), x, ["embed"], "trunk", ["head"])

    # the split of a LightningModule holding one: planned, the tied head and embedding named
    class Task(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _RenamedGPT()

    strategy = _strategy()
    strategy._split(Task(), (ids, ids))
    assert [list(r) for r in strategy.plan.blocks] == [[0, 1], [2, 3]]
    assert strategy._stage_split.tied == [("tok.weight", "out.weight")]


def test_a_forward_that_is_not_embedding_blocks_head_is_not_split():
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match=r"cannot split _RenamedGPT: no recognised structure.*pipeline_layout"):
        find_layout(_RenamedGPT(order=[3, 2, 1, 0]), ids)  # the blocks run in another order than they are listed
    with pytest.raises(ValueError, match=r"no recognised structure"):
        find_layout(_RenamedGPT(order=[0, 2, 1, 3]), ids)  # ... also when the first one runs first
    with pytest.raises(ValueError, match=r"no recognised structure"):
        find_layout(_RenamedGPT(order=[0, 1, 2, 3, 0]), ids)  # a block runs twice
    with pytest.raises(ValueError, match=r"no recognised structure"):
        find_layout(_FloatNet())  # float inputs and no batch: nothing to run the forward on


def test_the_first_batch_is_read_from_the_runs_own_loader_leaving_the_random_generator_alone():
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.randn(16, 6), torch.randn(16, 3)

    class Source:  # what Lightning's fit loop holds: the train loader's source
        def is_defined(self):
            return True

        def dataloader(self):
            return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)  # draws its seed from torch's RNG

    loop = SimpleNamespace(_data_source=Source())
    none = SimpleNamespace(_data_source=None)
    trainer = SimpleNamespace(
        state=SimpleNamespace(fn=TrainerFn.FITTING),
        fit_loop=loop,
        validate_loop=none,
        test_loop=none,
        predict_loop=none,
    )
    strategy = _strategy()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    inputs, targets = sample_batch(trainer, strategy._pipeline_batch)
    assert torch.equal(torch.get_rng_state(), before)  # the run's own draws (dropout, its sampler) are unchanged
    assert inputs.shape == (4, 6) and targets.shape == (4, 3)
    assert any(torch.equal(inputs[0], row) for row in x)  # a real sample, not a synthetic one
    trainer.state.fn = TrainerFn.VALIDATING  # validate: its loop's loader, here none
    assert sample_batch(trainer, strategy._pipeline_batch) is None

    # a float network with balance_shape given: measured on token ids it cannot take, refused with the fix
    task = _FloatTask()
    layout = _UserLayout(task.net, task.pipeline_layout())
    with pytest.raises(ValueError, match=r"balance_shape=\(2, 8\)\) measures on token ids.*leave balance_shape=None"):
        _strategy(balance="time", balance_shape=(2, 8))._timed_costs(layout, (x, y))
