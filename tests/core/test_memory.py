"""estimate_zero_memory: the ZeRO paper's Figure 1, hand formulas for offload, from_model, bad input, the CLI."""

from __future__ import annotations

import pytest
import torch

from lightning_accel.core.memory import ZERO_CONFIGS, count_model_params, estimate_zero_memory, zero_memory_table

GB = 1e9


@pytest.mark.parametrize(("stage", "expected_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_reproduces_zero_paper_figure_1(stage, expected_gb):
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5 B, N_d = 64, K = 12 (mixed-precision Adam)
    est = estimate_zero_memory(7.5e9, 64, stage)
    assert round(est.device_total / GB, 1) == expected_gb
    assert est.host_total == est.nvme_total == 0


def test_exact_stage_formulas():
    psi, nd, k = 1_000_000, 4, 12
    assert estimate_zero_memory(psi, nd, 0).device_total == (2 + 2 + k) * psi
    assert estimate_zero_memory(psi, nd, 1).device_total == 4 * psi + k * psi / nd
    assert estimate_zero_memory(psi, nd, 2).device_total == 2 * psi + (2 + k) * psi / nd
    assert estimate_zero_memory(psi, nd, 3).device_total == (2 + 2 + k) * psi / nd


def test_offload_hand_formulas():
    psi, nd = 8_000_000, 8
    # ZeRO-2 + optimizer offload (ZeRO-Offload §4.1): fp16 params stay (2 psi); the fp16 gradient shard and the
    # fp32 optimizer states of this rank move to the host: (2 + 12) psi / N
    e = estimate_zero_memory(psi, nd, 2, offload_optimizer="cpu")
    assert (e.device_params, e.device_grads, e.device_optimizer) == (2 * psi, 0, 0)
    assert e.host_total == (2 + 12) * psi / nd and e.nvme_total == 0
    # ZeRO-1 + offload keeps the full gradients on the device, as ZeRO-1 does
    e = estimate_zero_memory(psi, nd, 1, offload_optimizer="cpu")
    assert e.device_total == 4 * psi and e.host_total == 14 * psi / nd
    # ZeRO-3 + optimizer and parameter offload: nothing on the device, 16 psi / N on the host
    e = estimate_zero_memory(psi, nd, 3, offload_optimizer="cpu", offload_params="cpu")
    assert e.device_total == 0 and e.host_total == 16 * psi / nd
    e = estimate_zero_memory(psi, nd, 3, offload_optimizer="nvme", offload_params="nvme")
    assert e.device_total == e.host_total == 0 and e.nvme_total == 16 * psi / nd
    # ZeRO-3 + optimizer offload only: the parameter shard stays on the device
    e = estimate_zero_memory(psi, nd, 3, offload_optimizer=True)
    assert e.device_total == 2 * psi / nd and e.host_total == 14 * psi / nd


def test_configurable_k_frozen_params_and_activations():
    psi = 1000
    # pure fp32 Adam: 4-byte params and grads, K = 8 (momentum + variance)
    e = estimate_zero_memory(psi, 1, 0, optimizer_bytes_per_param=8, param_bytes=4, grad_bytes=4)
    assert e.device_total == 16 * psi
    # frozen parameters cost their bytes only (sharded at stage 3)
    assert estimate_zero_memory(psi, 2, 0, num_frozen_params=500).device_total == 16 * psi + 2 * 500
    assert estimate_zero_memory(psi, 2, 3, num_frozen_params=500).device_params == 2 * 1500 / 2
    e = estimate_zero_memory(psi, 2, 2, activation_bytes_per_sample=1e6, micro_batch_size=8)
    assert e.device_activations == 8e6 and e.device_total == 2 * psi + 14 * psi / 2 + 8e6


def test_from_model_counts_shared_parameters_once():
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied, as in GPT
    frozen = torch.nn.Linear(16, 16)
    frozen.requires_grad_(False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "frozen": frozen})
    assert count_model_params(model) == (1600, 16 * 16 + 16)
    est = estimate_zero_memory.from_model(model, 4, 2)
    assert est.num_params == 1600 and est.num_frozen_params == 272
    assert est.device_total == estimate_zero_memory(1600, 4, 2, num_frozen_params=272).device_total
    with pytest.raises(ValueError, match="counts num_params"):
        estimate_zero_memory.from_model(model, 4, 2, num_params=5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_params": -1}, "num_params=-1"),
        ({"num_params": 1.5}, "num_params=1.5"),
        ({"num_devices": 0}, "num_devices=0"),
        ({"stage": 4}, "stages are 0, 1, 2 and 3"),
        ({"offload_optimizer": "gpu"}, "offload_optimizer='gpu'"),
        ({"stage": 0, "offload_optimizer": "cpu"}, "stage >= 1"),
        ({"stage": 2, "offload_params": "cpu"}, "needs ZeRO stage 3"),
        ({"optimizer_bytes_per_param": -4}, "optimizer_bytes_per_param=-4"),
    ],
)
def test_bad_input_is_rejected_with_the_value(kwargs, match):
    args = {"num_params": 10, "num_devices": 2, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_zero_memory(args.pop("num_params"), args.pop("num_devices"), args.pop("stage"), **args)


def test_table_lists_every_configuration_in_order():
    rows = zero_memory_table(7.5e9, 64)
    assert [(r.stage, r.offload_optimizer, r.offload_params) for r in rows] == list(ZERO_CONFIGS)
    assert all(a.device_total >= b.device_total for a, b in zip(rows[:3], rows[1:4]))
    assert len(zero_memory_table(7.5e9, 64, include_nvme=False)) == len(ZERO_CONFIGS) - 1


def test_cli_prints_the_figure_1_table(capsys):
    from lightning_accel.cli import main

    assert main(["estimate-zero", "--params", "7.5e9", "--devices", "64", "--width", "200"]) == 0
    out = capsys.readouterr().out
    for label, gb in [("DDP (stage 0)", "120.00"), ("ZeRO-1 ", "31.41"), ("ZeRO-2 ", "16.64"), ("ZeRO-3 ", "1.88")]:
        line = next(line for line in out.splitlines() if label in line)
        assert gb in line, line
    assert "deepspeed_zero3_offload_nvme" in out and "7,500,000,000 parameters" in out
    assert main(["estimate-zero", "--params", "1.5", "--devices", "2"]) == 2
    assert "--params must be a whole number" in capsys.readouterr().err
