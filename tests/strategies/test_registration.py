"""Strategy strings are registered lazily: importing lightning_accel imports no deepspeed and touches no CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_import_registers_strings_without_importing_strategy_modules():
    code = (
        "import sys, torch, lightning_accel\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning_accel.strategies.registration import STRATEGIES\n"
        "assert all(name in StrategyRegistry for name in STRATEGIES), STRATEGIES\n"
        "loaded = [m for m in sys.modules if m == 'deepspeed' or m.startswith('deepspeed.')\n"
        "          or m.startswith(('lightning_accel.strategies.d', 'lightning_accel.strategies.m',\n"
        "                           'lightning_accel.strategies.p'))]\n"
        "assert not loaded, loaded\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(sorted(STRATEGIES))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(
        sorted(
            [
                "ddp_fp16_compress",
                "ddp_bf16_compress",
                "ddp_powersgd",
                "ddp_topk",
                "ddp_qsgd",
                "deepspeed_zero1",
                "deepspeed_zero2",
                "deepspeed_zero2_offload",
                "deepspeed_zero3",
                "deepspeed_zero3_offload",
                "deepspeed_zero3_offload_nvme",
                "deepspeed_auto",
                "fsdp2",
                "tp",
                "fsdp2_tp",
                "pp",
                "pp_ddp",
            ]
        )
    )


def test_demo_strategy_flag_is_validated_and_used():
    import argparse

    from lightning_accel.demo.run import DemoConfig, add_demo_arguments, build_trainer, config_from_args

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--strategy", "ddp_bf16_compress", "--devices", "2"]))
    cfg.validate()
    trainer = build_trainer(cfg)
    assert type(trainer.strategy).__name__ == "DDPCompressionStrategy" and trainer.strategy.compression == "bf16"
    with pytest.raises(ValueError, match="--strategy 'ddp_fp8'"):
        DemoConfig(strategy="ddp_fp8").validate()
