"""``lightning-accel demo --autopilot``: on the planted slow data the Autopilot keeps more loader workers, writes its
plan, and ``--autopilot-plan`` replays it without searching."""

import argparse
import json

import torch

from lightning_accel.demo.run import DemoConfig, add_demo_arguments, config_from_args, run_demo


def test_autopilot_flags_parse():
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    cfg = config_from_args(parser.parse_args([]))
    assert cfg.autopilot is False and cfg.autopilot_plan is None and cfg.autopilot_budget == 30.0
    cfg = config_from_args(parser.parse_args(["--autopilot", "--autopilot-budget", "12", "--autopilot-plan", "p.json"]))
    assert cfg.autopilot is True and cfg.autopilot_budget == 12.0 and cfg.autopilot_plan == "p.json"


def test_slow_data_demo_gets_workers_and_the_plan_replays(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    small = dict(
        steps=30,
        batch_size=8,
        seq_len=16,
        n_layer=1,
        d_model=32,
        window=5,
        val_every=100,
        progress_bar=False,
        slow_data=True,
        doctor=False,
        output_dir=str(tmp_path),
    )
    try:
        result = run_demo(DemoConfig(**small, autopilot=True, autopilot_budget=60.0))
        plan_path = tmp_path / "autopilot_plan.json"
        plan = json.loads(plan_path.read_text())
        assert plan["kept"] and plan["kept"][0]["name"] == "dataloader", plan["trials"]
        workers = plan["kept"][0]["params"]["num_workers"]
        assert result["trainer"].datamodule.num_workers == workers >= 1
        out = capsys.readouterr().out
        assert "Autopilot (rank 0)" in out and f"num_workers: {workers}" in out  # table + the LightningCLI fragment
        replay = run_demo(
            DemoConfig(**{**small, "output_dir": str(tmp_path / "replay")}, autopilot_plan=str(plan_path))
        )
    finally:
        torch.set_num_threads(threads)
    assert replay["trainer"].datamodule.num_workers == workers
    assert replay["autopilot"].stopped.startswith("replayed")
