"""DALIImageDataModule on CPU: outputs, numerics, sources, epochs, and errors that name the file."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.data.conftest import identify, write_solid_folder

pytestmark = pytest.mark.dali


def make(train=None, val=None, **kwargs):
    from lightning_accel.data.dali import DALIImageDataModule

    kwargs.setdefault("image_size", 32)
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_threads", 1)
    dm = DALIImageDataModule(train=train, val=val, **kwargs)
    dm.setup("fit" if train is not None else "validate")
    return dm


def collect(loader):
    ids, labels, count = [], [], 0
    for images, y in loader:
        ids += identify(images)
        labels += y.tolist()
        count += 1
    return ids, labels, count


@pytest.mark.parametrize("dtype,layout", [("float32", "NCHW"), ("float16", "NHWC")])
def test_shapes_dtypes_layouts_and_labels(solid_folder, dtype, layout):
    root, truth = solid_folder
    dm = make(root, root, dtype=dtype, layout=layout, val_batch_size=5)
    assert dm.classes == ["class_0", "class_1", "class_2"] and dm.num_classes == 3
    expected_shape = (4, 3, 32, 32) if layout == "NCHW" else (4, 32, 32, 3)
    label_of = {pid: label for pid, label in truth.values()}
    train = dm.train_dataloader()
    n = 0
    for images, labels in train:
        assert isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)
        assert tuple(images.shape) == expected_shape and images.dtype == getattr(torch, dtype)
        assert labels.dtype == torch.int64 and labels.shape == (4,)
        assert [label_of[i] for i in identify(images, layout=layout)] == labels.tolist()
        n += 1
    assert n == len(train) == 24 // 4
    val = dm.val_dataloader()
    sizes = [len(y) for _, y in val]
    assert sizes == [5, 5, 5, 5, 4] and len(val) == 5


def test_normalisation_matches_numpy_reference(tmp_path):
    """Lossless PNGs at the output size: no resampling, so the output is exactly (x - 255 mean) / (255 std)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)
    (tmp_path / "c").mkdir()
    for i, p in enumerate(pixels):
        Image.fromarray(p).save(tmp_path / "c" / f"{i}.png")
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    reference = (pixels.astype(np.float64) - np.array(mean) * 255) / (np.array(std) * 255)
    for dtype, layout, atol in (("float32", "NCHW", 1e-4), ("float16", "NHWC", 1e-2)):
        dm = make(val=tmp_path, mean=mean, std=std, dtype=dtype, layout=layout, val_resize=32, shuffle=False)
        images, _ = next(iter(dm.val_dataloader()))
        out = images.double().numpy()
        if layout == "NCHW":
            out = out.transpose(0, 2, 3, 1)
        np.testing.assert_allclose(out, reference, atol=atol, rtol=0)
    # train pipeline with a full-image crop: the reference, or its mirror image
    dm = make(train=tmp_path, mean=mean, std=std, random_area=(1.0, 1.0), random_aspect_ratio=(1.0, 1.0), shuffle=False)
    images, _ = next(iter(dm.train_dataloader()))
    out = images.double().numpy().transpose(0, 2, 3, 1)
    for got, ref in zip(out, reference):
        assert np.abs(got - ref).max() < 1e-4 or np.abs(got - ref[:, ::-1]).max() < 1e-4


def test_every_source_kind_reads_the_same_images(tmp_path, solid_folder):
    from lightning_accel.data.webdataset import pack_webdataset

    root, truth = solid_folder
    shards = tmp_path / "shards"
    pack_webdataset(root, shards, shard_size=10, progress_bar=False)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"images/{name} {label}\n" for name, (_, label) in truth.items()))
    pairs = [(str(root / name), label) for name, (_, label) in truth.items()]
    expected = sorted((pid, label) for pid, label in truth.values())
    for source in (root, shards, str(shards / "*.tar"), sorted(shards.glob("*.tar")), listing, pairs):
        dm = make(val=source, val_batch_size=5)
        ids, labels, _ = collect(dm.val_dataloader())
        assert sorted(zip(ids, labels)) == expected, source
    assert make(val=shards).classes == ["class_0", "class_1", "class_2"]


def test_epochs_reshuffle_and_an_interrupted_epoch_restarts_cleanly(solid_folder):
    root, _ = solid_folder
    dm = make(root, root, batch_size=8)
    train = dm.train_dataloader()
    first, _, n0 = collect(train)
    second, _, n1 = collect(train)
    assert n0 == n1 == len(train) == 3
    assert sorted(first) == sorted(second) == list(range(24)) and first != second
    val = dm.val_dataloader()
    it = iter(val)
    next(it)  # stop after one batch (limit_val_batches), then start again
    ids, _, n = collect(val)
    assert n == len(val) and sorted(ids) == list(range(24))


def test_pad_and_drop_batch_counts(tmp_path):
    root = tmp_path / "img"
    write_solid_folder(root, num_classes=3, per_class=7)  # 21 images
    drop = make(root, batch_size=4).train_dataloader()
    ids, _, n = collect(drop)
    assert n == len(drop) == 5 and len(set(ids)) == 20
    pad = make(root, batch_size=4, last_batch="pad").train_dataloader()
    ids, _, n = collect(pad)
    assert n == len(pad) == 6 and set(ids) == set(range(21)) and len(ids) == 24


def test_missing_and_empty_sources_are_named(tmp_path):
    from lightning_accel.data.dali import DALIImageDataModule

    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        make(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        make(tmp_path / "empty")
    (tmp_path / "noimg" / "cat").mkdir(parents=True)
    (tmp_path / "noimg" / "cat" / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="cat has no image files"):
        make(tmp_path / "noimg")
    listing = tmp_path / "list.txt"
    listing.write_text("a/missing.jpg 0\n")
    with pytest.raises(FileNotFoundError, match="a/missing.jpg is missing"):
        collect(make(val=listing, val_batch_size=1).val_dataloader())
    listing.write_text("a/x.jpg cat\n")
    with pytest.raises(ValueError, match="list.txt:1: expected '<path> <integer label>'"):
        make(val=listing)
    with pytest.raises(ValueError, match="decode_device"):
        DALIImageDataModule(train=tmp_path, decode_device="gpu")
    with pytest.raises(ValueError, match="layout"):
        DALIImageDataModule(train=tmp_path, layout="CHW")


def _corrupt(root: Path) -> tuple[Path, Path]:
    good = (root / "class_1" / "img_2.jpg").read_bytes()
    garbled = root / "class_1" / "img_3.jpg"  # valid JPEG markers at both ends, garbage in between
    garbled.write_bytes(
        good[:200] + bytes(np.random.default_rng(0).integers(0, 256, len(good) - 400, dtype=np.uint8)) + good[-200:]
    )
    text = root / "class_2" / "img_0.jpg"
    text.write_text("<html>not found</html>")
    return garbled, text


def test_corrupt_and_non_image_files_are_named(solid_folder):
    from lightning_accel.data.image_index import CorruptImageError

    root, _ = solid_folder
    good = (root / "class_1" / "img_3.jpg").read_bytes()
    garbled, text = _corrupt(root)
    with pytest.raises(CorruptImageError, match="class_2/img_0.jpg: not an image"):
        collect(make(val=root, val_batch_size=24).val_dataloader())
    text.unlink()
    loader = make(val=root, val_batch_size=4).val_dataloader()
    with pytest.raises(CorruptImageError, match="class_1/img_3.jpg") as err:
        collect(loader)
    assert err.value.files == ["class_1/img_3.jpg"] and "skip_corrupt=True" in str(err.value)
    garbled.write_bytes(good)  # fixed: the same loader runs a full epoch again
    ids, _, n = collect(loader)
    assert n == len(loader) and len(ids) == 23  # 24 minus the removed text file


def test_skip_corrupt_replaces_counts_and_keeps_batch_counts(solid_folder):
    root, truth = solid_folder
    garbled, text = _corrupt(root)
    dm = make(root, root, batch_size=4, skip_corrupt=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids, _, n = collect(dm.train_dataloader())
        ids2, _, n2 = collect(dm.train_dataloader())
    assert n == n2 == len(dm.train_dataloader()) == 6
    bad = {truth["class_1/img_3.jpg"][0], truth["class_2/img_0.jpg"][0]}
    assert not bad & set(ids + ids2) and len(ids) == 24
    assert dm.num_skipped == 2 and sorted(f.split(" ")[0] for f in dm.skipped_files) == [
        "class_1/img_3.jpg",
        "class_2/img_0.jpg",
    ]
    assert sum("skipping corrupt image" in str(w.message) for w in caught) == 2


def test_fit_delivers_torch_batches_to_training_step(solid_folder):
    import lightning.pytorch as pl

    root, _ = solid_folder
    seen = []

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 3)

        def training_step(self, batch, batch_idx):
            images, labels = batch
            seen.append((type(images), type(labels), images.device, labels.dtype, images.shape))
            return self.layer(images.mean(dim=(2, 3))).logsumexp(-1).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from lightning_accel.data.dali import DALIImageDataModule

    dm = DALIImageDataModule(train=root, image_size=32, batch_size=8, num_threads=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Probe(), datamodule=dm)
    assert trainer.num_training_batches == 3 and len(seen) == 6
    assert all(s == (torch.Tensor, torch.Tensor, torch.device("cpu"), torch.int64, (8, 3, 32, 32)) for s in seen)


def test_import_lightning_accel_does_not_import_dali():
    code = (
        "import sys, lightning_accel, lightning_accel.data; "
        "from lightning_accel.data import dali, memmap, webdataset; "
        "print('nvidia.dali' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answer")
def test_mixed_decode_without_cuda_says_so(solid_folder):
    root, _ = solid_folder
    with pytest.raises(ValueError, match="CUDA is not available"):
        make(root, decode_device="mixed").train_dataloader()
    assert make(root, decode_device="auto").train_dataloader().decode_device == "cpu"


@pytest.mark.gpu
def test_mixed_decode_on_gpu(solid_folder):
    root, truth = solid_folder
    dm = make(root, root, decode_device="mixed")
    images, labels = next(iter(dm.train_dataloader()))
    assert images.is_cuda and labels.is_cuda and labels.dtype == torch.int64
    label_of = {pid: label for pid, label in truth.values()}
    assert [label_of[i] for i in identify(images)] == labels.tolist()


@pytest.mark.gpu
def test_cpu_decode_for_a_cuda_trainer_delivers_on_the_gpu(solid_folder):
    import lightning.pytorch as pl

    root, truth = solid_folder
    dm = make(root, decode_device="cpu")
    dm.trainer = pl.Trainer(accelerator="cuda", devices=1, logger=False)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.is_cuda and labels.is_cuda and labels.dtype == torch.int64
    label_of = {pid: label for pid, label in truth.values()}
    assert [label_of[i] for i in identify(images)] == labels.tolist()


def test_auto_decode_device_follows_the_trainer(solid_folder, monkeypatch):
    """auto -> mixed on the Trainer's CUDA device (mocked: this checks the choice, not nvJPEG)."""
    from types import SimpleNamespace

    from lightning_accel.data.dali import DALIImageDataModule

    root, _ = solid_folder
    dm = DALIImageDataModule(train=root)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device, expected in ((torch.device("cuda", 1), ("mixed", 1)), (torch.device("cpu"), ("cpu", None))):
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=device))
        monkeypatch.setattr(dm, "_trainer_or_none", lambda t=trainer: t)
        assert dm._resolve_decode_device() == expected
    dm.decode_device = "cpu"
    monkeypatch.setattr(
        dm, "_trainer_or_none", lambda: SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    )
    assert dm._resolve_decode_device() == ("cpu", 0)  # decoded on the CPU, delivered on cuda:0 by DALI


def _fit_recording(root, ckpt_dir, *, resume_from=None, val_check_interval=None, fail_at=None, prefetch=False):
    """Fit 2 epochs of 6 batches; returns {(epoch, batch_idx): palette ids} and the warnings raised."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.data.dali import DALIImageDataModule

    seen: dict[tuple[int, int], list[int]] = {}

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 3)

        def training_step(self, batch, batch_idx):
            if (self.current_epoch, batch_idx) == fail_at:
                raise RuntimeError("simulated crash")  # OnExceptionCheckpoint saves, then fit re-raises
            seen[(self.current_epoch, batch_idx)] = identify(batch[0])
            return self.layer(batch[0].mean(dim=(2, 3))).logsumexp(-1).mean()

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if fail_at is not None:  # one checkpoint, written when the training step of fail_at raises
        from lightning.pytorch.callbacks import OnExceptionCheckpoint

        checkpoint = OnExceptionCheckpoint(dirpath=ckpt_dir, filename="interrupted")
    elif val_check_interval is None:  # a checkpoint after every training step
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}-{step}", save_top_k=-1, every_n_train_steps=1)
    else:  # a checkpoint after every (mid-epoch) validation
        checkpoint = ModelCheckpoint(
            dirpath=ckpt_dir, filename="{epoch}-{step}", save_top_k=-1, save_on_train_epoch_end=False
        )
    dm = DALIImageDataModule(
        train=root, val=root if val_check_interval else None, image_size=32, batch_size=4, num_threads=1, seed=3
    )
    from lightning_accel import DevicePrefetcher

    callbacks = [checkpoint] + ([DevicePrefetcher(depth=2)] if prefetch else [])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=val_check_interval,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(Probe(), datamodule=dm, ckpt_path=resume_from)
        except RuntimeError as err:
            if fail_at is None or "simulated crash" not in str(err):
                raise
    return seen, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "checkpoint,val_check_interval,first_batch,prefetch",
    [
        ("epoch=1-step=8.ckpt", None, 2, False),  # saved in on_train_batch_end, 2 batches into epoch 1
        ("epoch=0-step=6.ckpt", None, 0, False),  # saved at the end of epoch 0: epoch 1 starts afresh
        ("epoch=1-step=9.ckpt", 3, 3, False),  # saved after a mid-epoch validation, 3 batches into epoch 1
        ("epoch=1-step=8.ckpt", None, 2, True),  # DevicePrefetcher fetched 2 batches ahead: still not skipped
    ],
)
def test_mid_epoch_checkpoint_resumes_with_exactly_the_unseen_batches(
    solid_folder, tmp_path, checkpoint, val_check_interval, first_batch, prefetch
):
    root, _ = solid_folder  # 24 images: 6 batches of 4 per epoch
    full, _ = _fit_recording(root, tmp_path / "a", val_check_interval=val_check_interval, prefetch=prefetch)
    assert sorted(full) == [(e, b) for e in (0, 1) for b in range(6)]
    resumed, messages = _fit_recording(
        root,
        tmp_path / "b",
        resume_from=tmp_path / "a" / checkpoint,
        val_check_interval=val_check_interval,
        prefetch=prefetch,
    )
    assert sorted(resumed) == [(1, b) for b in range(first_batch, 6)]
    assert all(resumed[key] == full[key] for key in resumed)  # the same images, in the same batches
    assert not any("not resumable" in m for m in messages)


def test_checkpoint_of_an_interrupted_step_resumes_with_that_batch(solid_folder, tmp_path):
    """The loader has handed out the batch whose step raised; the resumed run must train on it."""
    root, _ = solid_folder
    full, _ = _fit_recording(root, tmp_path / "full")
    partial, _ = _fit_recording(root, tmp_path / "a", fail_at=(1, 3))
    assert sorted(partial) == [(0, b) for b in range(6)] + [(1, b) for b in range(3)]
    resumed, _ = _fit_recording(root, tmp_path / "b", resume_from=tmp_path / "a" / "interrupted.ckpt")
    assert sorted(resumed) == [(1, b) for b in range(3, 6)]
    assert all(resumed[key] == full[key] for key in resumed)


def test_resume_with_another_world_size_skips_no_unseen_batch_and_repeats_none(solid_folder):
    """A checkpoint from 2 ranks x batch 4, 1 batch into epoch 0, resumed on 1 rank x batch 4."""
    from lightning_accel.data.dali import _DALILoader
    from lightning_accel.data.sharding import epoch_plan

    root, _ = solid_folder
    dm = make(root, batch_size=4, seed=3)
    loader = dm.train_dataloader()
    assert isinstance(loader, _DALILoader)
    consumed = np.concatenate(
        [
            epoch_plan(24, batch_size=4, rank=r, world_size=2, shuffle=True, seed=3, epoch=0, last_batch="drop")[0]
            for r in (0, 1)
        ]
    )  # 8 samples
    state = {
        "epoch": 0,
        "samples_done": 8,
        "batch_size": 4,
        "world_size": 2,
        "num_samples": 24,
        "seed": 3,
        "shuffle": True,
        "last_batch": "drop",
    }
    loader.load_state_dict(state)
    ids, _, n = collect(loader)
    assert n == 4 and len(ids) == 16  # 8 samples done = exactly 2 batches of this 1-rank loader
    index = dm._index["train"]
    palette_of = {i: int(p) for i, p in enumerate(_palette_ids(index))}
    assert sorted(ids + [palette_of[int(i)] for i in consumed]) == list(range(24))
    # a batch size that does not divide the position: round up and say how many samples are skipped
    # (without a Trainer each pass over the loader is the next epoch: 1 now, then 2)
    loader.load_state_dict({**state, "epoch": 1, "samples_done": 6, "world_size": 1, "batch_size": 3})
    with pytest.warns(UserWarning, match="2 sample\\(s\\) of this epoch are skipped"):
        ids, _, n = collect(loader)
    assert n == 4
    # other data: the position cannot be mapped, the epoch is read from its start
    loader.load_state_dict({**state, "epoch": 2, "num_samples": 30})
    with pytest.warns(UserWarning, match="cannot be mapped"):
        ids, _, n = collect(loader)
    assert n == 6 and sorted(ids) == list(range(24))
    assert loader.state_dict()["samples_done"] == 24 and loader.state_dict()["epoch"] == 2
    # a state from another loader or version: said, and the epoch is read whole
    with pytest.warns(UserWarning, match="lacks \\['samples_done'\\]"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "samples_done"})
    ids, _, n = collect(loader)
    assert n == 6 and sorted(ids) == list(range(24))


def _palette_ids(index):
    """Palette id of each sample of an ImageIndex over write_solid_folder's images (from the file names)."""
    per_class = 8
    out = []
    for name in index.names:
        label, image = name.split("/")[-2:]
        out.append(int(label.split("_")[1]) * per_class + int(image.split("_")[1].split(".")[0]))
    return out


def test_bottleneck_doctor_reads_the_dali_pipeline_and_names_its_knobs(tmp_path):
    """The doctor learns the loader is DALI (not a DataLoader), so a data finding names num_threads and
    prefetch_queue_depth instead of num_workers; the CPU line counts DALI's threads in the process."""
    import lightning.pytorch as pl

    from lightning_accel import BottleneckDoctor
    from lightning_accel.core.rules import Thresholds
    from lightning_accel.data.dali import DALIImageDataModule

    root = tmp_path / "images"
    write_solid_folder(root, num_classes=3, per_class=8)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 3)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0].mean(dim=(2, 3))).logsumexp(-1).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # a tiny model: nearly all of the step is waiting for DALI, so the data finding fires (threshold 1 %)
    doctor = BottleneckDoctor(
        window=4, warmup_batches=2, report_path=False, print_report=False, thresholds=Thresholds(data_share=0.01)
    )
    dm = DALIImageDataModule(train=root, image_size=32, batch_size=2, num_threads=1, prefetch_queue_depth=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor],
    )
    trainer.fit(Tiny(), datamodule=dm)
    report = doctor.report
    assert (
        report.context.loader,
        report.context.decode_device,
        report.context.loader_threads,
        report.context.prefetch_queue_depth,
    ) == ("DALIImageDataModule", "cpu", 1, 2)
    (finding,) = [f for f in report.findings if f.rule == "data_wait"]
    assert "DALIImageDataModule(decode_device='cpu', num_threads=1" in finding.evidence
    assert "num_workers" not in finding.fix and "prefetch_queue_depth=3" in finding.fix
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report.table())
    text = console.export_text()
    assert "DALIImageDataModule's threads included" in text and "DataLoader workers" not in text


def test_lightning_cli_configures_the_data_module_from_yaml(tmp_path, monkeypatch):
    """A LightningCLI user sets DALIImageDataModule from a config file (paths, tuples, the resume-safe defaults)."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_accel.data.dali import DALIImageDataModule
    from lightning_accel.demo.images import ImageTask

    root = tmp_path / "images"
    write_solid_folder(root, num_classes=3, per_class=8)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"data:\n  train: {root}\n  val: {root}\n  image_size: 32\n  batch_size: 4\n  num_threads: 1\n"
        f"  random_area: [0.5, 1.0]\n  dtype: float16\n  layout: NHWC\nmodel:\n  num_classes: 3\n"
        f"trainer:\n  max_epochs: 1\n  logger: false\n  enable_progress_bar: false\n"
        f"  enable_model_summary: false\n  accelerator: cpu\n  default_root_dir: {tmp_path}\n"
    )
    monkeypatch.chdir(tmp_path)
    seen = []

    class Task(ImageTask):
        def forward(self, images):
            seen.append((images.dtype, tuple(images.shape)))
            return super().forward(images.permute(0, 3, 1, 2).float())

    cli = LightningCLI(
        Task, DALIImageDataModule, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True}
    )
    dm = cli.datamodule
    assert (dm.random_area, dm.layout, dm.dtype, dm.image_size) == ((0.5, 1.0), "NHWC", "float16", 32)
    assert cli.trainer.num_training_batches == 6 and seen[0] == (torch.float16, (4, 32, 32, 3))


def test_the_tuners_in_the_recommended_stack_work_with_the_data_module(tmp_path):
    """callbacks/accelerate.yaml puts BatchSizeTuner and DataLoaderTuner before fit: with DALIImageDataModule the
    batch-size search rebuilds the DALI pipeline at each probed size, and DataLoaderTuner says it has nothing to tune
    instead of failing the run."""
    import lightning.pytorch as pl

    from lightning_accel import BatchSizeTuner, DataLoaderTuner
    from lightning_accel.data.dali import DALIImageDataModule
    from lightning_accel.demo.images import ImageTask

    root = tmp_path / "images"
    write_solid_folder(root, num_classes=3, per_class=8)
    sizes = []

    class Task(ImageTask):
        def training_step(self, batch, batch_idx):
            sizes.append(len(batch[1]))
            return super().training_step(batch, batch_idx)

    dm = DALIImageDataModule(train=root, image_size=32, batch_size=2, num_threads=1)
    tuner = BatchSizeTuner(init_batch_size=2, max_batch_size=8, memory_fraction=0.9, steps_per_trial=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tuner, DataLoaderTuner()],
    )
    with pytest.warns(UserWarning, match="DataLoaderTuner: the training data comes from DALIImageDataModule"):
        trainer.fit(Task(num_classes=3), datamodule=dm)
    assert dm.batch_size == 8  # the tiny CNN fits the cap (24 images / 1 rank, max_batch_size=8)
    assert trainer.num_training_batches == 3 and sizes[-3:] == [8, 8, 8]
    assert len(set(sizes[:-3])) > 1  # the probes ran at several sizes through rebuilt pipelines
