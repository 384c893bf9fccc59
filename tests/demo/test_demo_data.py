"""The demo's data paths: GPT windows from pack_memmap shards; the image demo through DALIImageDataModule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_accel.data.memmap import TokenMemmapDataset
from lightning_accel.demo.data import markov_tokens
from lightning_accel.demo.task import DemoDataModule


def test_gpt_demo_reads_packed_token_windows(tmp_path):
    dm = DemoDataModule(seq_len=16, batch_size=4, train_tokens=2000, val_tokens=500, seed=3, data_dir=tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    assert isinstance(dm._train, TokenMemmapDataset) and isinstance(dm._val, TokenMemmapDataset)
    stream = markov_tokens(2500, 256, seed=3)
    x, y = dm._train[5]
    assert x.tolist() == stream[80:96].tolist() and y.tolist() == stream[81:97].tolist()
    assert dm._val[0][0].tolist() == stream[2000:2016].tolist()
    mtime = (tmp_path / "train" / "index.json").stat().st_mtime_ns
    DemoDataModule(seq_len=16, train_tokens=2000, val_tokens=500, seed=3, data_dir=tmp_path).prepare_data()
    assert (tmp_path / "train" / "index.json").stat().st_mtime_ns == mtime  # reused, not re-packed
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 16) and xb.dtype == torch.int64 and torch.equal(xb[:, 1:], yb[:, :-1])


@pytest.mark.dali
def test_image_demo_trains_a_cnn_through_dali(tmp_path):
    from lightning_accel.demo.run import DemoConfig, run_demo

    result = run_demo(
        DemoConfig(
            data="images", steps=6, val_every=6, batch_size=16, window=2, progress_bar=False, output_dir=str(tmp_path)
        )
    )
    assert np.isfinite(result["train_loss"]) and 0.0 <= result["val_acc"] <= 1.0
    assert len(list((tmp_path / "data" / "images" / "train").glob("class_*/*.jpg"))) == 640
    assert result["mfu_monitor"]["samples_per_sec"] > 0
