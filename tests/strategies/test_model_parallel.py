"""The automatic plan and the size arithmetic of fsdp2 / tp / fsdp2_tp, in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.strategies.model_parallel import AutoParallelStrategy, batch_replicas
from lightning_accel.strategies.parallel_plan import derive_plan, regroup_fused_qkv


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def tiny_llama(heads: int = 4, kv: int = 2, tie: bool = False) -> nn.Module:
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            tie_word_embeddings=tie,
        )
    )


def tiny_litgpt(heads: int = 4, groups: int = 2) -> nn.Module:
    pytest.importorskip("litgpt", reason="needs litgpt (model code): pip install --no-deps litgpt")
    from litgpt import GPT, Config

    return GPT(
        Config(
            n_layer=2,
            n_head=heads,
            n_query_groups=groups,
            n_embd=48,
            block_size=16,
            vocab_size=64,
            padded_vocab_size=64,
            bias=False,
            mlp_class_name="LLaMAMLP",
            intermediate_size=96,
            norm_class_name="RMSNorm",
        )
    )


def test_hf_plan_is_the_libraries_own_with_every_layer():
    plan = derive_plan(Holder(tiny_llama()), tp_size=2, fsdp=True)
    styles = plan.tp_dict()
    assert styles["model.model.layers.1.self_attn.q_proj"] == "colwise"
    assert styles["model.model.layers.0.self_attn.o_proj"] == "rowwise"
    assert styles["model.model.layers.1.mlp.down_proj"] == "rowwise"
    library = tiny_llama().tp_plan  # what the installed transformers plans (5.0: the decoder layers only)
    if "lm_head" in library:
        assert styles["model.lm_head"] == "colwise_gather_output"
        assert styles["model.model.embed_tokens"] == "embedding_rowwise"
    else:
        assert "model.lm_head" in plan.replicated and "model.model.embed_tokens" in plan.replicated
    assert all(e.source == "hf" for e in plan.tp)
    assert "model.model.norm" in plan.replicated
    assert plan.fsdp_units == ["model.model.layers.0", "model.model.layers.1", "model"]
    text = plan.describe()
    assert "Hugging Face tp_plan of LlamaForCausalLM" in text
    assert "model.model.layers.*.self_attn.q_proj" in text and "(x2)" in text


def test_hf_tied_embeddings_stay_replicated():
    plan = derive_plan(Holder(tiny_llama(tie=True)), tp_size=2)
    assert "model.lm_head" not in plan.tp_dict() and "model.model.embed_tokens" not in plan.tp_dict()
    assert "model.lm_head" in plan.replicated
    if "lm_head" in tiny_llama().tp_plan:  # the library would shard it: the tie is why it is not
        assert any("ties its input and output" in n for n in plan.notes)


def test_litgpt_plan_from_structure():
    plan = derive_plan(Holder(tiny_litgpt()), tp_size=2, fsdp=True)
    styles = plan.tp_dict()
    assert styles == {
        **{f"model.transformer.h.{i}.attn.qkv": "fused_qkv_colwise" for i in range(2)},
        **{f"model.transformer.h.{i}.attn.proj": "rowwise" for i in range(2)},
        **{f"model.transformer.h.{i}.mlp.fc_1": "colwise" for i in range(2)},
        **{f"model.transformer.h.{i}.mlp.fc_2": "colwise" for i in range(2)},
        **{f"model.transformer.h.{i}.mlp.proj": "rowwise" for i in range(2)},
    }
    assert "model.transformer.wte" in plan.replicated and "model.transformer.ln_f" in plan.replicated
    assert plan.fsdp_units == ["model.transformer.h.0", "model.transformer.h.1", "model"]


def test_heads_that_do_not_divide_the_tp_size_name_module_and_sizes():
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 does not divide the 2 key/value heads of "
        r"'model.model.layers.0.self_attn' \(LlamaForCausalLM\).*\[1, 2\]",
    ):
        derive_plan(Holder(tiny_llama(heads=4, kv=2)), tp_size=4)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 does not divide the 4 attention heads of "
        r"'model.transformer.h.0.attn' \(CausalSelfAttention\)",
    ):
        derive_plan(Holder(tiny_litgpt()), tp_size=3)


def test_model_without_recognised_blocks_lists_what_was_found():
    model = Holder(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)))
    with pytest.raises(ValueError, match=r"no recognised attention or MLP blocks.*model \(Sequential\).*Conv2d x2"):
        derive_plan(model, tp_size=2)
    # FSDP2 needs no blocks: the top-level modules are the units
    assert derive_plan(model, fsdp=True).fsdp_units == ["model"]


def test_unknown_fused_qkv_layout_is_refused_for_tp_but_sharded_by_fsdp2():
    from lightning_accel.demo.model import GPT, GPTConfig

    demo = Holder(GPT(GPTConfig(seq_len=16, n_layer=2, d_model=32)))
    with pytest.raises(ValueError, match="fused linear 'qkv' whose row layout this plan does not know"):
        derive_plan(demo, tp_size=2)
    assert derive_plan(demo, fsdp=True).fsdp_units == ["model.blocks.0", "model.blocks.1", "model"]


def test_generic_attention_and_mlp_get_per_rank_head_counts():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16) for _ in range(4))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    holder = Holder(nn.ModuleList([Block(), Block()]))
    plan = derive_plan(holder, tp_size=2)
    assert plan.tp_dict()["model.0.mlp.0"] == "colwise" and plan.tp_dict()["model.0.mlp.2"] == "rowwise"
    assert plan.heads_by_module == {"model.0.attn": {"num_heads": 4}, "model.1.attn": {"num_heads": 4}}
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 does not divide the 4 attention heads of "
        r"'model.0.attn' \(Attention\); use a tensor-parallel size among \[1, 2, 4\]",
    ):
        derive_plan(holder, tp_size=3)
    holder.p = nn.Parameter(torch.zeros(1))  # a parameter FSDP2 could not reduce
    with pytest.raises(ValueError, match=r"registers parameters directly on itself \(p\)"):
        derive_plan(holder, fsdp=True)


def test_regroup_fused_qkv_gives_each_rank_its_heads_and_inverts():
    # 4 query heads, 2 groups, head size 1: rows q0 q1 q2 q3 k0 k1 v0 v1
    rows = torch.arange(8.0)
    out = regroup_fused_qkv(rows, n_head=4, n_query_groups=2, head_size=1, tp_size=2)
    assert out.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]  # rank 0: q0 q1 k0 v0 | rank 1: q2 q3 k1 v1
    assert regroup_fused_qkv(out, n_head=4, n_query_groups=2, head_size=1, tp_size=2, inverse=True).equal(rows)
    with pytest.raises(ValueError, match="do not match n_head=4"):
        regroup_fused_qkv(torch.zeros(7), n_head=4, n_query_groups=2, head_size=1, tp_size=2)


@pytest.mark.parametrize(
    ("mode", "dp", "tp", "world", "per_node", "expected"),
    [
        ("fsdp2", "auto", "auto", 8, 8, (8, 1)),
        ("tp", "auto", "auto", 4, 4, (1, 4)),
        ("fsdp2_tp", "auto", "auto", 16, 8, (2, 8)),
        ("fsdp2_tp", "auto", 4, 16, 8, (4, 4)),
        ("fsdp2_tp", 2, "auto", 8, 8, (2, 4)),
    ],
)
def test_sizes(mode, dp, tp, world, per_node, expected):
    strategy = AutoParallelStrategy(mode=mode, data_parallel_size=dp, tensor_parallel_size=tp)
    assert strategy.resolve_sizes(world, per_node) == expected


def test_bad_sizes_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 on 4 devices would leave 2 data-parallel replicas"):
        AutoParallelStrategy(mode="tp", tensor_parallel_size=2).resolve_sizes(4, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 × data_parallel_size=auto does not fit 8 devices"):
        AutoParallelStrategy(mode="fsdp2_tp", tensor_parallel_size=3).resolve_sizes(8, 8)
    with pytest.raises(ValueError, match="fsdp2 has no tensor parallelism; use strategy 'fsdp2_tp'"):
        AutoParallelStrategy(mode="fsdp2", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be 'auto' or an integer >= 1"):
        AutoParallelStrategy(mode="tp", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="mode='zero'"):
        AutoParallelStrategy(mode="zero")  # type: ignore[arg-type]


def test_strings_build_the_strategy():
    import lightning.pytorch as pl

    import lightning_accel  # noqa: F401

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="fsdp2_tp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert isinstance(trainer.strategy, AutoParallelStrategy) and trainer.strategy.mode == "fsdp2_tp"


def test_batch_replicas():
    class Fake:
        def __init__(self, world: int, replicas: int) -> None:
            self.world_size, self.distributed_sampler_kwargs = world, {"num_replicas": replicas, "rank": 0}

    assert batch_replicas(Fake(8, 2)) == 4  # TP size 4
    assert batch_replicas(Fake(8, 8)) == 1  # DDP / FSDP2
    assert batch_replicas(object()) == 1  # single device: no sampler kwargs
