import argparse

import torch

from lightning_accel.demo.run import DemoConfig, add_demo_arguments, config_from_args, run_demo


def test_doctor_flags_parse():
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    cfg = config_from_args(parser.parse_args([]))
    assert cfg.doctor is True and cfg.slow_data is False and cfg.doctor_report is None
    cfg = config_from_args(parser.parse_args(["--no-doctor", "--slow-data", "--doctor-report", "x.json"]))
    assert cfg.doctor is False and cfg.slow_data is True and cfg.doctor_report == "x.json"


def test_slow_data_demo_is_diagnosed_as_data(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = DemoConfig(
            steps=24,
            batch_size=8,
            seq_len=16,
            n_layer=1,
            d_model=32,
            window=5,
            val_every=100,
            progress_bar=False,
            slow_data=True,
            doctor_report=str(tmp_path / "before.json"),
        )
        result = run_demo(cfg)
    finally:
        torch.set_num_threads(threads)
    report = result["doctor"]
    assert report.bottleneck == "data"
    assert report.findings[0].rule == "data_wait" and "num_workers" in report.findings[0].fix
    assert (tmp_path / "before.json").is_file()
    out = capsys.readouterr().out
    # the doctor's report comes after MFUMonitor's summary
    assert out.index("MFUMonitor summary") < out.index("BottleneckDoctor report")
