"""``pack_webdataset``: an ImageFolder tree → WebDataset ``.tar`` shards plus a class index.

Thousands of small JPEGs cost one random read (and one metadata lookup) each; a few large shards are read
sequentially or by offset from one open file. The shards follow the WebDataset convention (members
``<key>.<ext>`` and ``<key>.cls`` with the class index as ASCII), so the ``webdataset`` library, DALI's
``readers.webdataset`` and :class:`~lightning_accel.data.dali.DALIImageDataModule` all read them.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np

from lightning_accel._atomic import atomic_path, atomic_write_json
from lightning_accel._checks import check_int
from lightning_accel.data._progress import progress
from lightning_accel.data.image_index import CLASSES_FILE, index_image_folder, sniff_image_format

__all__ = ["pack_webdataset"]


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # reproducible shards: identical input -> identical bytes
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def pack_webdataset(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    shard_size: int = 1000,
    shuffle: bool = True,
    seed: int = 0,
    prefix: str = "shard",
    verify: bool = True,
    progress_bar: bool = True,
) -> dict:
    """Pack an ImageFolder tree (``src_dir/<class>/<image>``) into WebDataset tar shards in ``out_dir``.

    Each shard is written to a temporary file in ``out_dir``, fsynced and renamed into place, so an interrupted
    pack never leaves a partial shard; ``classes.json`` (class names, sample and shard counts) is written last, the
    same way, and marks a complete pack.

    Args:
        src_dir: the class-folder tree; classes are the sorted sub-folder names.
        out_dir: created if missing; existing shards with the same names are replaced.
        shard_size: images per shard (the last shard holds the rest).
        shuffle: write the samples in a seeded random order, so that a sequential reader of a shard sees mixed
            classes (WebDataset readers shuffle only within a buffer).
        seed: seed of that order.
        prefix: shard file names are ``{prefix}-{i:06d}.tar``.
        verify: check that every file is an image (magic bytes) and name the first that is not.
        progress_bar: show a rich progress bar.

    Returns:
        The index written to ``classes.json``: ``classes``, ``num_samples``, ``shards`` (name and sample count).
    """
    check_int("pack_webdataset", "shard_size", shard_size, unit="images per shard", example=1000)
    src = Path(src_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"pack_webdataset: source folder {src} does not exist")
    index = index_image_folder(src)
    out = Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"pack_webdataset: out_dir must differ from src_dir ({src})")
    out.mkdir(parents=True, exist_ok=True)
    # a re-pack first removes the old class index: until the new one is written, the folder is marked incomplete
    (out / CLASSES_FILE).unlink(missing_ok=True)
    order = np.random.default_rng(seed).permutation(len(index)) if shuffle else np.arange(len(index))
    shards: list[dict] = []
    digits = max(8, len(str(len(index))))
    with progress(len(index), f"packing {src.name} -> {out}", progress_bar) as bar:
        for start in range(0, len(order), shard_size):
            name = f"{prefix}-{len(shards):06d}.tar"
            chunk = order[start : start + shard_size]
            with atomic_path(out / name) as tmp, tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
                for key_num, sample in zip(range(start, start + len(chunk)), chunk):
                    path = index.files[int(sample)]
                    data = Path(path).read_bytes()
                    if verify and sniff_image_format(data) is None:
                        raise ValueError(
                            f"pack_webdataset: {path} is not an image ({len(data)} bytes starting "
                            f"{data[:8]!r}); remove it from {src}"
                        )
                    ext = Path(path).suffix.lower().lstrip(".")
                    key = f"{key_num:0{digits}d}"
                    _add_member(tar, f"{key}.{ext}", data)
                    _add_member(tar, f"{key}.cls", str(int(index.labels[sample])).encode())
                    bar.advance()
            shards.append({"name": name, "num_samples": len(chunk)})
    keep = {s["name"] for s in shards}
    for old in out.glob(f"{prefix}-*.tar"):  # shards of an earlier, larger pack into the same folder
        if old.name not in keep:
            old.unlink()
    meta = {"format": "webdataset", "classes": index.classes, "num_samples": len(index), "shards": shards}
    atomic_write_json(out / CLASSES_FILE, meta)
    return meta
