"""pack_memmap and the memmap datasets: round trips, lazy mapping, workers, atomic shards, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.data.memmap import (
    MemmapDataModule,
    MemmapDataset,
    TokenMemmapDataset,
    pack_memmap,
    read_memmap_index,
)


@pytest.fixture
def samples(tmp_path):
    x = np.random.default_rng(0).normal(size=(103, 2, 5)).astype(np.float32)
    y = np.arange(103) % 7
    meta = pack_memmap(x, tmp_path / "s", labels=y, shard_bytes=40 * 4 * 10, progress_bar=False)
    return x, y, meta, tmp_path / "s"


def test_samples_round_trip_and_index(samples):
    x, y, meta, path = samples
    assert [s["count"] for s in meta["shards"]] == [40, 40, 23]
    assert json.loads((path / "index.json").read_text()) == meta
    assert meta["dtype"] == "<f4" and meta["sample_shape"] == [2, 5] and meta["num_samples"] == 103
    ds = MemmapDataset(path)
    assert ds._data.opened == 0  # nothing mapped until read
    assert len(ds) == 103
    for i in (0, 39, 40, 102, -1):
        sample, label = ds[i]
        assert torch.equal(sample, torch.from_numpy(x[i])) and label == y[i]
    assert ds._data.opened == 3
    idx = [102, 0, 41, 40, 5, 41]
    for (sample, label), i in zip(ds.__getitems__(idx), idx):
        assert torch.equal(sample, torch.from_numpy(x[i])) and label == y[i]
    with pytest.raises(IndexError):
        ds[103]


def test_samples_from_an_iterable_and_wide_dtypes(tmp_path):
    arrays = [np.full((3,), i, dtype=np.uint16) for i in range(10)]
    pack_memmap(iter(arrays), tmp_path / "u", shard_bytes=12, progress_bar=False)
    ds = MemmapDataset(tmp_path / "u")
    assert len(ds) == 10 and ds[7].dtype == torch.int64 and ds[7].tolist() == [7, 7, 7]
    with pytest.raises(ValueError, match="sample 2 has shape"):
        pack_memmap([np.zeros(3), np.zeros(3), np.zeros(4)], tmp_path / "bad", progress_bar=False)
    with pytest.raises(ValueError, match="fewer labels"):
        pack_memmap(np.zeros((3, 2)), tmp_path / "bad", labels=[1, 2], progress_bar=False)


def test_tokens_windows_across_shards(tmp_path):
    stream = np.random.default_rng(1).integers(0, 50_000, size=1001)
    meta = pack_memmap(stream, tmp_path / "t", kind="tokens", shard_bytes=2 * 300, progress_bar=False)
    assert meta["dtype"] == "<u2" and [s["count"] for s in meta["shards"]] == [300, 300, 300, 101]
    ds = TokenMemmapDataset(tmp_path / "t", seq_len=64)
    assert len(ds) == (1001 - 1) // 64
    for i in range(len(ds)):  # windows 4 and 9 cross shard boundaries
        x, y = ds[i]
        assert x.dtype == torch.int64 and x.tolist() == stream[i * 64 : i * 64 + 64].tolist()
        assert y.tolist() == stream[i * 64 + 1 : i * 64 + 65].tolist()
    overlapping = TokenMemmapDataset(tmp_path / "t", seq_len=10, stride=3)
    assert len(overlapping) == (1001 - 11) // 3 + 1
    assert overlapping[-1][1].tolist() == stream[(len(overlapping) - 1) * 3 + 1 :][:10].tolist()
    docs = [np.arange(5), np.arange(3)]
    pack_memmap(docs, tmp_path / "d", kind="tokens", eos=99, progress_bar=False)
    assert TokenMemmapDataset(tmp_path / "d", seq_len=9)[0][0].tolist() == [0, 1, 2, 3, 4, 99, 0, 1, 2]
    with pytest.raises(ValueError, match="dtype=np.uint32"):
        pack_memmap([np.array([70_000])], tmp_path / "x", kind="tokens", dtype=np.uint16, progress_bar=False)


def test_wrong_kind_missing_index_and_bad_arguments(samples, tmp_path):
    _, _, _, path = samples
    with pytest.raises(ValueError, match="read it with MemmapDataset"):
        TokenMemmapDataset(path, seq_len=4)
    with pytest.raises(FileNotFoundError, match="not a pack_memmap folder"):
        MemmapDataset(tmp_path)
    with pytest.raises(ValueError, match="seq_len"):
        TokenMemmapDataset(path, seq_len=0)
    with pytest.raises(ValueError, match="kind"):
        pack_memmap(np.zeros(3), tmp_path / "k", kind="text")
    pack_memmap(np.arange(100), tmp_path / "tok", kind="tokens", progress_bar=False)
    with pytest.raises(ValueError, match="pass seq_len"):
        MemmapDataModule(train=tmp_path / "tok").setup("fit")


def test_interrupted_pack_leaves_no_partial_shard_and_no_index(tmp_path):
    def samples():
        for i in range(25):
            if i == 17:
                raise RuntimeError("disk full")
            yield np.full((4,), i, dtype=np.int32)

    pack_memmap(np.zeros((3, 4), np.int32), tmp_path / "out", progress_bar=False)  # an earlier pack there
    with pytest.raises(RuntimeError, match="disk full"):
        pack_memmap(samples(), tmp_path / "out", shard_bytes=5 * 16, progress_bar=False)
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert left == [f"shard-00000{i}.npy" for i in range(3)]  # three complete shards of 5; no temp file, no index
    assert all(np.load(tmp_path / "out" / name).shape == (5, 4) for name in left)
    with pytest.raises(FileNotFoundError, match="interrupted"):
        read_memmap_index(tmp_path / "out")


def _workers() -> dict:
    """Worker processes from a fork server: forking this long-lived test process (the persistent threads of earlier
    tests: tqdm's monitor, inductor's compile pool, the native thread pools) can hand a worker a lock held by a
    thread that does not exist in it; once in CI a worker hung on its first batch. The datasets are also pickled to
    the workers this way, as under ``spawn``."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["lightning_accel.data.memmap"])  # each worker starts with the module imported
    return {"num_workers": 2, "multiprocessing_context": context, "timeout": 120}


def test_datasets_with_two_workers(samples, tmp_path):
    x, y, _, path = samples
    loader = DataLoader(
        MemmapDataset(path), batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(0), **_workers()
    )
    got_x, got_y = [], []
    for bx, by in loader:
        got_x.append(bx)
        got_y.append(by)
    got_x, got_y = torch.cat(got_x), torch.cat(got_y)
    order = torch.from_numpy(x.reshape(103, -1)[:, 0]).argsort()
    assert torch.equal(got_x[got_x[:, 0, 0].argsort()], torch.from_numpy(x)[order])
    assert sorted(got_y.tolist()) == sorted(y.tolist())
    stream = np.arange(2001) % 251
    pack_memmap(stream, tmp_path / "t", kind="tokens", shard_bytes=500, progress_bar=False)
    tokens = DataLoader(TokenMemmapDataset(tmp_path / "t", seq_len=50), batch_size=8, **_workers())
    xs = torch.cat([bx for bx, _ in tokens])
    assert torch.equal(xs.reshape(-1), torch.from_numpy(stream[:2000] % 251).long())


def test_datamodule_defaults_and_fit(samples, tmp_path):
    import lightning.pytorch as pl

    _, _, _, path = samples
    dm = MemmapDataModule(train=path, val=path, batch_size=16, num_workers=2)
    dm.setup("fit")
    settings = dm.loader_settings()
    assert settings == {
        "batch_size": 16,
        "num_workers": 2,
        "pin_memory": False,
        "persistent_workers": True,
        "prefetch_factor": 4,
    }
    loader = dm.train_dataloader()
    assert loader.drop_last and len(loader) == 103 // 16
    assert MemmapDataModule(train=path, num_workers=0).loader_settings() == {
        "batch_size": 32,
        "num_workers": 0,
        "pin_memory": False,
    }

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(10, 7)

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return torch.nn.functional.cross_entropy(self.layer(xb.flatten(1)), yb)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(Probe(), datamodule=MemmapDataModule(train=path, batch_size=16, num_workers=0))
    assert trainer.global_step == 103 // 16


def test_cli_pack_memmap(tmp_path, capsys):
    from lightning_accel.cli import main

    files = tmp_path / "files"
    files.mkdir()
    for i in range(6):
        np.save(files / f"{i:03d}.npy", np.full((2, 3), i, dtype=np.float32))
    assert main(["pack", "memmap", str(files), str(tmp_path / "s"), "--no-progress-bar"]) == 0
    assert "packed 6 samples (<f4) from 6 file(s)" in capsys.readouterr().out
    ds = MemmapDataset(tmp_path / "s")
    assert [float(ds[i][0, 0]) for i in range(6)] == [0, 1, 2, 3, 4, 5]
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "a.bin")
    assert (
        main(
            [
                "pack",
                "memmap",
                str(tmp_path / "a.bin"),
                str(tmp_path / "t"),
                "--kind",
                "tokens",
                "--bin-dtype",
                "uint16",
                "--dtype",
                "uint16",
                "--no-progress-bar",
            ]
        )
        == 0
    )
    assert TokenMemmapDataset(tmp_path / "t", seq_len=9)[0][1].tolist() == list(range(1, 10))
    assert main(["pack", "memmap", str(tmp_path / "a.bin"), str(tmp_path / "t2"), "--kind", "tokens"]) == 2
    assert "--bin-dtype" in capsys.readouterr().err
