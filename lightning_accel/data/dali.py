"""``DALIImageDataModule``: image decode and augmentation in NVIDIA DALI, sharded correctly under DDP.

Where the time goes in an image pipeline is decode + augment; DALI does both in C++ threads (CPU) or with nvJPEG
(``mixed``: Huffman decoding on the CPU, the rest on the GPU), and its ROI decode
(``fn.decoders.image_random_crop``) decodes only the crop window of a random-resized crop. The file reading and
sharding are done here, in Python, from :func:`lightning_accel.data.sharding.epoch_plan` through
``fn.external_source``: that gives a global per-epoch shuffle identical on every rank, equal batch counts per rank
(no DDP hang), validation without double counting, and errors that name the corrupt file (DALI's own decode error
does not say which file failed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_accel._checks import check_int
from lightning_accel.core.utilisation import usable_cores_per_rank
from lightning_accel.data._dali_loader import _dali, _DALILoader
from lightning_accel.data._dali_source import _BatchSource
from lightning_accel.data.image_index import ImageIndex, ImageSource, resolve_image_source
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["DALIImageDataModule", "IMAGENET_MEAN", "IMAGENET_STD"]

#: ImageNet channel statistics on the [0, 1] scale (the values torchvision's pretrained models use)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: validation resizes the shorter side to ``image_size / 0.875`` then centre-crops (224 -> 256 -> 224), the
#: standard ImageNet evaluation protocol (e.g. DALI's RN50 example, torchvision references)
VAL_CROP_FRACTION = 0.875
#: nvJPEG buffer pre-allocation from DALI's ImageNet RN50 example (avoids reallocations in the first iterations)
_DEVICE_MEMORY_PADDING = 211_025_920
_HOST_MEMORY_PADDING = 140_544_512

_DTYPES = {"float32": "FLOAT", "fp32": "FLOAT", "float16": "FLOAT16", "fp16": "FLOAT16"}


class DALIImageDataModule(pl.LightningDataModule):
    """Image classification data decoded and augmented by NVIDIA DALI, sharded over DDP ranks.

    Batches reach ``training_step`` as ``(images, labels)``: ``images`` a float tensor ``(B, 3, H, W)`` (NCHW) or
    ``(B, H, W, 3)`` (NHWC), normalised with ``mean``/``std``; ``labels`` int64 ``(B,)``; both on the Trainer's
    GPU when it runs on CUDA (with CPU decoding too: DALI copies them from pinned memory), on the CPU otherwise.

    Train pipeline: ROI decode with a random-resized crop (``fn.decoders.image_random_crop``: area
    ``random_area``, aspect ratio ``random_aspect_ratio``) → resize to ``image_size`` → random horizontal flip →
    normalise (``fn.crop_mirror_normalize``). Validation: decode → resize the shorter side to ``val_resize`` →
    centre crop ``image_size`` → normalise.

    Under DDP each rank reads ``1/world_size`` of the samples (strided over a shuffled order that changes every
    epoch and is identical on every rank); every rank runs the same number of batches (``last_batch``: ``"drop"``
    the remainder or ``"pad"`` by wrapping around); validation reads every sample exactly once.

    Args:
        train: training images: an ImageFolder tree (``root/<class>/<image>``), WebDataset ``.tar`` shard(s) (a
            folder of them, a glob, or a list), a text file list of ``<path> <label>`` lines, or a sequence of
            ``(path, label)``.
        val: validation images, same forms; ``None`` for no validation.
        image_size: output height and width in pixels.
        batch_size: per-rank batch size for training.
        val_batch_size: per-rank batch size for validation (default ``batch_size``).
        val_resize: shorter side before the validation centre crop (default ``round(image_size / 0.875)``).
        num_threads: DALI CPU threads per rank (default: the CPU cores divided among the local ranks, at most 8).
        prefetch_queue_depth: batches DALI prepares ahead.
        seed: seed of the shuffle (the same on every rank) and of the augmentation (offset per rank).
        decode_device: ``"mixed"`` (nvJPEG on the GPU), ``"cpu"``, or ``"auto"``: mixed when the Trainer runs on
            CUDA, CPU otherwise.
        mean: per-channel mean on the [0, 1] scale (ImageNet's by default).
        std: per-channel standard deviation on the [0, 1] scale.
        dtype: ``"float32"`` or ``"float16"`` output.
        layout: ``"NCHW"`` or ``"NHWC"``.
        last_batch: ``"drop"`` or ``"pad"``, for training.
        shuffle: shuffle the training order (every epoch differently).
        random_area: range of the crop area as a fraction of the image (torchvision's RandomResizedCrop default).
        random_aspect_ratio: range of the crop aspect ratio.
        mirror_probability: probability of a horizontal flip in training.
        skip_corrupt: replace unreadable or undecodable images by another image of the source (deterministically,
            so every rank keeps its batch count) and count them in :attr:`num_skipped`, instead of raising an error
            that names the file.
    """

    def __init__(
        self,
        *,
        train: ImageSource | None = None,
        val: ImageSource | None = None,
        image_size: int = 224,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        val_resize: int | None = None,
        num_threads: int | None = None,
        prefetch_queue_depth: int = 2,
        seed: int = 0,
        decode_device: str = "auto",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        dtype: str | torch.dtype = "float32",
        layout: str = "NCHW",
        last_batch: str = "drop",
        shuffle: bool = True,
        random_area: tuple[float, float] = (0.08, 1.0),
        random_aspect_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        mirror_probability: float = 0.5,
        skip_corrupt: bool = False,
    ) -> None:
        super().__init__()
        if train is None and val is None:
            raise ValueError("DALIImageDataModule: pass train=... and/or val=... (a folder, .tar shards or a list)")
        for name, value in (
            ("image_size", image_size),
            ("batch_size", batch_size),
            ("prefetch_queue_depth", prefetch_queue_depth),
        ):
            check_int("DALIImageDataModule", name, value)
        for name, value in (
            ("val_batch_size", val_batch_size),
            ("val_resize", val_resize),
            ("num_threads", num_threads),
        ):
            check_int("DALIImageDataModule", name, value, optional=True)
        if val_resize is not None and val_resize < image_size:
            raise ValueError(
                f"DALIImageDataModule: val_resize={val_resize} is smaller than image_size="
                f"{image_size}; the centre crop needs val_resize >= image_size"
            )
        if decode_device not in ("auto", "cpu", "mixed"):
            raise ValueError(
                f"DALIImageDataModule: decode_device must be 'auto', 'cpu' or 'mixed', got {decode_device!r}"
            )
        if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
            raise ValueError(
                f"DALIImageDataModule: mean and std need 3 values (RGB, [0, 1] scale) and std > 0, "
                f"got mean={tuple(mean)}, std={tuple(std)}"
            )
        dtype_name = str(dtype).replace("torch.", "")
        if dtype_name not in _DTYPES:
            raise ValueError(f"DALIImageDataModule: dtype must be 'float32' or 'float16', got {dtype!r}")
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"DALIImageDataModule: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if last_batch not in ("drop", "pad"):
            raise ValueError(
                f"DALIImageDataModule: last_batch must be 'drop' or 'pad' (validation always reads "
                f"every sample once), got {last_batch!r}"
            )
        if not (0 < random_area[0] <= random_area[1] <= 1):
            raise ValueError(f"DALIImageDataModule: random_area must satisfy 0 < low <= high <= 1, got {random_area}")
        if not (0 < random_aspect_ratio[0] <= random_aspect_ratio[1]):
            raise ValueError(
                f"DALIImageDataModule: random_aspect_ratio must satisfy 0 < low <= high, got {random_aspect_ratio}"
            )
        if not 0 <= mirror_probability <= 1:
            raise ValueError(f"DALIImageDataModule: mirror_probability must be in [0, 1], got {mirror_probability}")
        self.train_source, self.val_source = train, val
        self.image_size, self.batch_size = image_size, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.val_resize = val_resize or round(image_size / VAL_CROP_FRACTION)
        self.num_threads, self.prefetch_queue_depth, self.seed = num_threads, prefetch_queue_depth, seed
        self.decode_device = decode_device
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.dtype, self.layout = dtype_name, layout
        self.last_batch, self.shuffle = last_batch, shuffle
        self.random_area = (float(random_area[0]), float(random_area[1]))
        self.random_aspect_ratio = (float(random_aspect_ratio[0]), float(random_aspect_ratio[1]))
        self.mirror_probability = float(mirror_probability)
        self.skip_corrupt = skip_corrupt
        self._index: dict[str, ImageIndex] = {}
        self._loaders: dict[str, _DALILoader] = {}
        self._own_epoch = 0

    # ----------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, stage: str) -> None:
        _dali()  # fail early with the install line
        if stage == "fit" and self.train_source is None:
            raise ValueError("DALIImageDataModule: trainer.fit needs train=...")
        for split, source in (("train", self.train_source), ("val", self.val_source)):
            if source is not None and split not in self._index:
                self._index[split] = resolve_image_source(source)

    @property
    def classes(self) -> list[str] | None:
        """Class names (sorted folder names, or ``classes.json`` of packed shards); ``None`` if unknown."""
        index = self._index.get("train") or self._index.get("val")
        return index.classes if index is not None else None

    @property
    def num_classes(self) -> int:
        """Number of classes (from the class names, else the largest label + 1); after :meth:`setup`."""
        index = self._index.get("train") or self._index.get("val")
        if index is None:
            raise RuntimeError("DALIImageDataModule.num_classes is known after setup()")
        return len(index.classes) if index.classes else int(index.labels.max()) + 1

    @property
    def pipeline_settings(self) -> dict[str, Any]:
        """This is a DALI pipeline, not a DataLoader: ``DataLoaderTuner`` steps aside and ``BottleneckDoctor``
        names these knobs (``decode_device`` is the configured one; the train loader reports the resolved one)."""
        return {
            "loader": "DALIImageDataModule",
            "decode_device": self.decode_device,
            "loader_threads": self._threads(),
            "prefetch_queue_depth": self.prefetch_queue_depth,
        }

    @property
    def num_skipped(self) -> int:
        """Corrupt images skipped (``skip_corrupt=True``) so far on this rank."""
        return sum(len(loader.source.bad) for loader in self._loaders.values())

    @property
    def skipped_files(self) -> list[str]:
        """Names of the corrupt images skipped on this rank, with the reason."""
        return [
            f"{loader.index.names[s]} ({r})" for loader in self._loaders.values() for s, r in loader.source.bad.items()
        ]

    def _distributed(self) -> tuple[int, int]:
        trainer = self._trainer_or_none()
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _trainer_or_none(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    def _resolve_decode_device(self) -> tuple[str, int | None]:
        """The decoder's device and the GPU the batches are delivered on (``None``: delivered on the CPU).

        CPU decoding for a Trainer on CUDA still delivers on the Trainer's GPU: DALI copies each batch from its
        own pinned buffers on a side stream, where Lightning would copy from pageable memory and block.
        """
        trainer = self._trainer_or_none()
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        choice = self.decode_device
        if choice == "auto":
            choice = "mixed" if device.type == "cuda" else "cpu"
        if choice == "mixed":
            if not torch.cuda.is_available():
                raise ValueError(
                    "DALIImageDataModule: decode_device='mixed' decodes on the GPU but CUDA is not "
                    "available; use decode_device='cpu' or 'auto'"
                )
            index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
            return "mixed", index
        if device.type == "cuda":
            return "cpu", device.index if device.index is not None else torch.cuda.current_device()
        return "cpu", None

    def _threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        trainer = self._trainer_or_none()
        if trainer is not None:
            local_ranks = max(1, trainer.num_devices)
        return max(1, min(8, usable_cores_per_rank(local_ranks)))

    def _epoch(self) -> int:
        trainer = self._trainer_or_none()
        if trainer is not None:
            return trainer.current_epoch
        epoch, self._own_epoch = self._own_epoch, self._own_epoch + 1
        return epoch

    def _loader(self, split: str) -> _DALILoader:
        if split not in self._index:
            self.setup("fit" if split == "train" else "validate")
            if split not in self._index:
                raise ValueError(f"DALIImageDataModule: no {split}=... source was given")
        batch_size = self.batch_size if split == "train" else self.val_batch_size
        stale = self._loaders.get(split)
        if stale is not None and stale.batch_size != batch_size:  # e.g. BatchSizeTuner set a new batch_size
            stale._discard()  # its pipeline only: the image index is shared with the new loader
            del self._loaders[split]
        if split not in self._loaders:
            rank, world_size = self._distributed()
            decode_device, device_id = self._resolve_decode_device()
            train = split == "train"
            self._loaders[split] = _DALILoader(
                self,
                self._index[split],
                train=train,
                batch_size=batch_size,
                rank=rank,
                world_size=world_size,
                decode_device=decode_device,
                device_id=device_id,
                epoch_fn=self._epoch if train else (lambda: 0),
            )
        return self._loaders[split]

    @override
    def train_dataloader(self) -> _DALILoader:
        return self._loader("train")

    @override
    def val_dataloader(self) -> _DALILoader | list:
        return self._loader("val") if self.val_source is not None else []

    @override
    def teardown(self, stage: str) -> None:
        finish_collectives_at_teardown(self, self.trainer)
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()

    # ----------------------------------------------------------------------------------------------- pipeline
    def _pipeline(
        self,
        source: _BatchSource,
        *,
        train: bool,
        batch_size: int,
        decode_device: str,
        device_id: int | None,
        seed: int,
        dali: ModuleType,
    ) -> Any:
        fn, types = dali.fn, dali.types
        pipe = dali.pipeline.Pipeline(
            batch_size=batch_size,
            num_threads=self._threads(),
            device_id=device_id,
            seed=seed,
            prefetch_queue_depth=self.prefetch_queue_depth,
        )
        with pipe:
            encoded, labels = fn.external_source(
                source=source, num_outputs=2, batch=True, batch_info=True, dtype=[types.UINT8, types.INT32], ndim=[1, 0]
            )
            images = self._decode_and_augment(encoded, train=train, decode_device=decode_device, dali=dali)
            if device_id is not None:  # deliver on the GPU (after CPU decoding: copied from DALI's pinned buffers)
                images = images if decode_device == "mixed" else images.gpu()
                labels = labels.gpu()
            pipe.set_outputs(images, labels)
        return pipe

    def _decode_and_augment(self, encoded: Any, *, train: bool, decode_device: str, dali: ModuleType) -> Any:
        """The operators from encoded bytes to normalised images, inside a pipeline definition
        (``benchmarks/bench_dali.py`` runs the same ones behind DALI's own file reader)."""
        fn, types = dali.fn, dali.types
        decoder_args: dict[str, Any] = {"device": decode_device, "output_type": types.RGB}
        if decode_device == "mixed":
            decoder_args.update(device_memory_padding=_DEVICE_MEMORY_PADDING, host_memory_padding=_HOST_MEMORY_PADDING)
        size = self.image_size
        if train:
            images = fn.decoders.image_random_crop(
                encoded,
                random_area=list(self.random_area),
                random_aspect_ratio=list(self.random_aspect_ratio),
                num_attempts=10,
                **decoder_args,
            )
            images = fn.resize(images, resize_x=size, resize_y=size)
            mirror = fn.random.coin_flip(probability=self.mirror_probability)
            crop_args: dict[str, Any] = {"mirror": mirror}
        else:
            images = fn.decoders.image(encoded, **decoder_args)
            images = fn.resize(images, resize_shorter=self.val_resize)
            crop_args = {"crop": (size, size), "crop_pos_x": 0.5, "crop_pos_y": 0.5}
        return fn.crop_mirror_normalize(
            images,
            dtype=getattr(types, _DTYPES[self.dtype]),
            output_layout="CHW" if self.layout == "NCHW" else "HWC",
            mean=[m * 255.0 for m in self.mean],
            std=[s * 255.0 for s in self.std],
            **crop_args,
        )

    def expected_batches(self, split: str = "train") -> int:
        """Batches per rank per epoch for ``split`` with the current world size (after :meth:`setup`)."""
        return len(self._loader(split))
