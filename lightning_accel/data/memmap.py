"""Memory-mapped shards: ``pack_memmap`` writes them; ``MemmapDataset``, ``TokenMemmapDataset`` and
``MemmapDataModule`` read them.

The fix for per-sample file overhead: pre-process once into a few large ``.npy`` shards that every DataLoader worker
maps, so reading a sample is a page-cache lookup instead of an ``open`` + parse. See docs/techniques/packing.md,
which shows the folder's layout and ``index.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_accel._atomic import atomic_path, atomic_write_json
from lightning_accel._checks import check_int
from lightning_accel.core.utilisation import usable_cores_per_rank
from lightning_accel.data._progress import progress
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

__all__ = ["INDEX_FILE", "MemmapDataModule", "MemmapDataset", "TokenMemmapDataset", "pack_memmap", "read_memmap_index"]

INDEX_FILE = "index.json"
FORMAT = "lightning-accel-memmap"
#: 256 MiB shards: large enough that per-file costs vanish, small enough to write and copy comfortably
DEFAULT_SHARD_BYTES = 256 * 2**20
#: numpy dtypes torch cannot hold (or barely operates on) are widened to int64 when read
_WIDEN = {np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64)}


def _token_dtype(max_token: int) -> np.dtype:
    # nanoGPT's convention: uint16 while the vocabulary fits (GPT-2's 50257 does), else uint32
    return np.dtype(np.uint16) if max_token < 2**16 else np.dtype(np.uint32)


def _write_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype, shape=array.shape)
        mm[...] = array
        mm.flush()
        del mm


def pack_memmap(
    data: np.ndarray | Iterable[Any],
    out_dir: str | os.PathLike,
    *,
    kind: str = "samples",
    labels: np.ndarray | Iterable[int] | None = None,
    dtype: Any = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    eos: int | None = None,
    prefix: str = "shard",
    progress_bar: bool = True,
) -> dict:
    """Write ``data`` as numpy memmap shards plus ``index.json`` into ``out_dir``.

    Args:
        data: ``kind="samples"``: an array ``(N, *shape)`` or an iterable of equally shaped arrays (one per
            sample). ``kind="tokens"``: a 1-D token array, or an iterable of 1-D arrays (documents) concatenated
            into one stream.
        out_dir: created if missing; a previous pack there is replaced (its index is removed first).
        kind: ``"samples"`` (fixed-shape samples, read by :class:`MemmapDataset`) or ``"tokens"`` (a flat stream,
            read by :class:`TokenMemmapDataset`).
        labels: one integer per sample (``kind="samples"`` only); stored beside each shard.
        dtype: storage dtype; default: the data's dtype for samples; for tokens ``uint16`` when every token
            < 65536 (an array input), else ``uint32``.
        shard_bytes: target size of one shard file.
        eos: token appended after every document (``kind="tokens"`` with an iterable of documents).
        prefix: shard file names are ``{prefix}-{i:06d}.npy``.
        progress_bar: show a rich progress bar (samples or tokens written).

    Returns:
        The index that was written to ``index.json``.
    """
    if kind not in ("samples", "tokens"):
        raise ValueError(f"pack_memmap: kind must be 'samples' or 'tokens', got {kind!r}")
    check_int("pack_memmap", "shard_bytes", shard_bytes, unit="bytes")
    if labels is not None and kind == "tokens":
        raise ValueError("pack_memmap: labels are for kind='samples'; a token stream's targets are its next tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_FILE).unlink(missing_ok=True)  # until the new index is written, the folder reads as incomplete
    if kind == "tokens":
        meta = _pack_tokens(
            data, out, dtype=dtype, shard_bytes=shard_bytes, eos=eos, prefix=prefix, progress_bar=progress_bar
        )
    else:
        meta = _pack_samples(
            data, out, labels=labels, dtype=dtype, shard_bytes=shard_bytes, prefix=prefix, progress_bar=progress_bar
        )
    keep = {f for s in meta["shards"] for f in (s["file"], s.get("labels")) if f}
    for old in out.glob(f"{prefix}-*.npy"):  # shards of an earlier, larger pack into the same folder
        if old.name not in keep:
            old.unlink()
    atomic_write_json(out / INDEX_FILE, meta)
    return meta


def _pack_samples(
    data: Any, out: Path, *, labels: Any, dtype: Any, shard_bytes: int, prefix: str, progress_bar: bool
) -> dict:
    total = len(data) if hasattr(data, "__len__") else 0
    label_iter = iter(labels) if labels is not None else None
    shards: list[dict] = []
    buffer: np.ndarray | None = None
    label_buffer: np.ndarray | None = None
    filled = 0
    shape: tuple[int, ...] | None = None
    store: np.dtype | None = None
    count = 0

    def flush() -> None:
        nonlocal filled
        if buffer is None or filled == 0:
            return
        name = f"{prefix}-{len(shards):06d}"
        _write_npy(out / f"{name}.npy", buffer[:filled])
        entry: dict[str, Any] = {"file": f"{name}.npy", "count": filled}
        if label_buffer is not None:
            _write_npy(out / f"{name}.labels.npy", label_buffer[:filled])
            entry["labels"] = f"{name}.labels.npy"
        shards.append(entry)
        filled = 0

    with progress(total, f"packing samples -> {out}", progress_bar) as bar:
        for sample in data:
            array = np.asarray(sample)
            if shape is None:
                shape, store = array.shape, np.dtype(dtype) if dtype is not None else array.dtype
                per_shard = max(1, shard_bytes // max(1, int(np.prod(shape)) * store.itemsize))
                buffer = np.empty((per_shard, *shape), dtype=store)
                label_buffer = np.empty(per_shard, dtype=np.int64) if label_iter is not None else None
            elif array.shape != shape:
                raise ValueError(
                    f"pack_memmap: sample {count} has shape {array.shape}, the first had {shape}; "
                    f"MemmapDataset needs fixed-shape samples"
                )
            assert buffer is not None
            buffer[filled] = array
            if label_iter is not None:
                assert label_buffer is not None
                try:
                    label_buffer[filled] = int(next(label_iter))
                except StopIteration:
                    raise ValueError(f"pack_memmap: fewer labels than samples (ran out at sample {count})") from None
            filled += 1
            count += 1
            bar.advance()
            if filled == len(buffer):
                flush()
        flush()
    if count == 0:
        raise ValueError("pack_memmap: no samples to pack")
    if label_iter is not None and next(label_iter, None) is not None:
        raise ValueError(f"pack_memmap: more labels than the {count} samples")
    assert shape is not None and store is not None
    return {
        "format": FORMAT,
        "version": 1,
        "kind": "samples",
        "dtype": store.str,
        "sample_shape": list(shape),
        "num_samples": count,
        "has_labels": labels is not None,
        "shards": shards,
    }


def _pack_tokens(
    data: Any, out: Path, *, dtype: Any, shard_bytes: int, eos: int | None, prefix: str, progress_bar: bool
) -> dict:
    if isinstance(data, np.ndarray) or torch.is_tensor(data):
        array = np.asarray(data)
        if array.ndim != 1:
            raise ValueError(f"pack_memmap: a token stream must be 1-D, got shape {array.shape}")
        if array.size == 0:
            raise ValueError("pack_memmap: no tokens to pack")
        if dtype is None:
            if array.min() < 0:
                raise ValueError(f"pack_memmap: negative token id {int(array.min())}")
            dtype = _token_dtype(int(array.max()))
        documents: Iterable[np.ndarray] = [array]
        total = int(array.size) + (1 if eos is not None else 0)
    else:
        documents, total = data, 0
    store = np.dtype(dtype if dtype is not None else np.uint32)
    if store.kind not in "iu":
        raise ValueError(f"pack_memmap: tokens need an integer dtype, got {store}")
    info = np.iinfo(store)
    per_shard = max(1, shard_bytes // store.itemsize)
    buffer = np.empty(per_shard, dtype=store)
    filled = 0
    shards: list[dict] = []
    count = 0

    def flush() -> None:
        nonlocal filled
        if filled:
            name = f"{prefix}-{len(shards):06d}.npy"
            _write_npy(out / name, buffer[:filled])
            shards.append({"file": name, "count": filled})
            filled = 0

    with progress(total, f"packing tokens -> {out}", progress_bar) as bar:
        for doc_number, doc in enumerate(documents):
            tokens = np.asarray(doc).reshape(-1)
            if eos is not None:
                tokens = np.concatenate([tokens, np.asarray([eos], dtype=tokens.dtype)])
            if tokens.size and (tokens.min() < info.min or tokens.max() > info.max):
                raise ValueError(
                    f"pack_memmap: document {doc_number} has token ids in [{tokens.min()}, "
                    f"{tokens.max()}], outside {store}'s range; pass dtype=np.uint32 (or wider)"
                )
            start = 0
            while start < tokens.size:
                take = min(per_shard - filled, tokens.size - start)
                buffer[filled : filled + take] = tokens[start : start + take]
                filled += take
                start += take
                if filled == per_shard:
                    flush()
            count += int(tokens.size)
            bar.advance(int(tokens.size))
        flush()
    if count == 0:
        raise ValueError("pack_memmap: no tokens to pack")
    return {"format": FORMAT, "version": 1, "kind": "tokens", "dtype": store.str, "num_tokens": count, "shards": shards}


def read_memmap_index(path: str | os.PathLike, kind: str | None = None) -> dict:
    """The ``index.json`` of a shard folder, checked (and of ``kind`` when given)."""
    folder = Path(path)
    index_file = folder / INDEX_FILE
    if not index_file.is_file():
        hint = " (an interrupted pack_memmap leaves no index: run it again)" if folder.is_dir() else ""
        raise FileNotFoundError(f"{index_file} not found: {folder} is not a pack_memmap folder{hint}")
    meta = json.loads(index_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{index_file}: format {meta.get('format')!r} is not {FORMAT!r}")
    if kind is not None and meta["kind"] != kind:
        reader = {"samples": "MemmapDataset", "tokens": "TokenMemmapDataset"}[meta["kind"]]
        raise ValueError(f"{folder} holds kind={meta['kind']!r} data; read it with {reader}")
    for shard in meta["shards"]:
        for key in ("file", "labels"):
            if shard.get(key) and not (folder / shard[key]).is_file():
                raise FileNotFoundError(f"{folder / shard[key]} listed in {index_file} is missing")
    return meta


class _Shards:
    """Shard files opened lazily, once per process: a DataLoader worker maps what it reads, nothing more."""

    def __init__(self, folder: Path, files: Sequence[str]) -> None:
        self.folder, self.files = folder, list(files)
        self._maps: list[np.ndarray] | None = None
        self._pid = -1

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "files": self.files, "_maps": None, "_pid": -1}

    def get(self, shard: int) -> np.ndarray:
        if self._maps is None or self._pid != os.getpid():  # a forked worker maps its own
            self._maps = [None] * len(self.files)  # type: ignore[list-item]
            self._pid = os.getpid()
        mm = self._maps[shard]
        if mm is None:
            mm = self._maps[shard] = np.load(self.folder / self.files[shard], mmap_mode="r")
        return mm

    @property
    def opened(self) -> int:
        """Shards mapped in this process (for tests: nothing is mapped before the first read)."""
        return 0 if self._maps is None or self._pid != os.getpid() else sum(m is not None for m in self._maps)


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype in _WIDEN:
        array = array.astype(np.int64)
    elif not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array)  # a view into the read-only map: copy the sample out of it
    return torch.from_numpy(array)


class MemmapDataset(Dataset):
    """Fixed-shape samples from a ``pack_memmap(kind="samples")`` folder, memory-mapped lazily per process.

    ``dataset[i]`` is a tensor of the stored sample shape (``uint16/32/64`` widened to ``int64``), or
    ``(sample, label)`` when labels were packed. ``__getitems__`` (used by ``DataLoader`` for a whole batch)
    reads each shard's part of the batch with one sorted fancy index.

    Args:
        path: the folder ``pack_memmap`` wrote.
        transform: applied to each sample tensor.
    """

    def __init__(self, path: str | os.PathLike, *, transform: Any = None) -> None:
        self.path = Path(path)
        meta = read_memmap_index(self.path, "samples")
        self.sample_shape = tuple(meta["sample_shape"])
        self.dtype = np.dtype(meta["dtype"])
        self.has_labels = bool(meta.get("has_labels"))
        self.transform = transform
        counts = np.asarray([s["count"] for s in meta["shards"]], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._data = _Shards(self.path, [s["file"] for s in meta["shards"]])
        self._labels = _Shards(self.path, [s["labels"] for s in meta["shards"]]) if self.has_labels else None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"MemmapDataset index {index} out of range for {len(self)} samples")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])

    def _item(self, sample: np.ndarray, label: Any) -> Any:
        x = _to_tensor(sample)
        if self.transform is not None:
            x = self.transform(x)
        return (x, int(label)) if self.has_labels else x

    def __getitem__(self, index: int) -> Any:
        shard, local = self._locate(int(index))
        label = self._labels.get(shard)[local] if self._labels is not None else None
        return self._item(self._data.get(shard)[local], label)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + len(self), idx)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"MemmapDataset indices out of range for {len(self)} samples")
        shards = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[Any] = [None] * len(idx)
        for shard in np.unique(shards):
            where = np.nonzero(shards == shard)[0]
            local = idx[where] - self._starts[shard]
            order = np.argsort(local, kind="stable")  # sorted reads walk the file forwards
            block = self._data.get(int(shard))[local[order]]
            labels = self._labels.get(int(shard))[local[order]] if self._labels is not None else [None] * len(order)
            for k, pos in enumerate(where[order]):
                out[pos] = self._item(block[k], labels[k])
        return out


class TokenMemmapDataset(Dataset):
    """Language-model windows over a ``pack_memmap(kind="tokens")`` stream: ``(input, target)`` pairs.

    Window ``i`` covers tokens ``[i * stride, i * stride + seq_len + 1)`` of the flat stream (across shard
    boundaries); ``input`` is its first ``seq_len`` tokens and ``target`` the next-token shift (both int64).

    Args:
        path: the folder ``pack_memmap`` wrote.
        seq_len: tokens per input sequence.
        stride: start-to-start distance of windows (default ``seq_len``: non-overlapping inputs).
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, *, stride: int | None = None) -> None:
        check_int("TokenMemmapDataset", "seq_len", seq_len, unit="tokens")
        check_int("TokenMemmapDataset", "stride", stride, optional=True, unit="tokens")
        self.path = Path(path)
        meta = read_memmap_index(self.path, "tokens")
        self.seq_len, self.stride = seq_len, stride or seq_len
        self.num_tokens = int(meta["num_tokens"])
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"TokenMemmapDataset: {self.path} holds {self.num_tokens} tokens, fewer than one "
                f"window of seq_len + 1 = {seq_len + 1}"
            )
        counts = np.asarray([s["count"] for s in meta["shards"]], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._shards = _Shards(self.path, [s["file"] for s in meta["shards"]])

    def __len__(self) -> int:
        return (self.num_tokens - self.seq_len - 1) // self.stride + 1

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (a copy, read across shards as needed)."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        shard = first
        while start < stop:
            begin = start - int(self._starts[shard])
            end = min(stop, int(self._starts[shard + 1])) - int(self._starts[shard])
            pieces.append(self._shards.get(shard)[begin:end])
            start = int(self._starts[shard]) + end
            shard += 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"TokenMemmapDataset index {index} out of range for {len(self)} windows")
        start = index * self.stride
        window = torch.from_numpy(self.tokens(start, start + self.seq_len + 1).astype(np.int64))
        return window[:-1], window[1:]


def default_num_workers(local_ranks: int = 1, accelerators_per_rank: int = 1) -> int:
    """DataLoader workers per rank: the method's "about 4 per GPU", capped at half of this rank's CPU cores."""
    return max(1, min(4 * accelerators_per_rank, usable_cores_per_rank(2 * max(1, local_ranks))))


class MemmapDataModule(pl.LightningDataModule):
    """Train/val DataLoaders over memmap shard folders with the method's DataLoader settings.

    The folder's kind decides the dataset: ``"samples"`` → :class:`MemmapDataset`, ``"tokens"`` →
    :class:`TokenMemmapDataset` (``seq_len`` required). Under DDP Lightning adds a ``DistributedSampler`` and calls
    ``set_epoch`` each epoch.

    Defaults (docs/method.md, "Data"): ``num_workers`` about 4 per GPU, at most half the cores of this rank;
    ``pin_memory`` when the Trainer runs on CUDA; ``persistent_workers`` when there are workers (no re-fork per
    epoch); ``prefetch_factor=4``; training shuffles and drops the ragged last batch.

    Args:
        train: training shard folder.
        val: validation shard folder, or ``None``.
        seq_len: window length for token folders.
        batch_size: per-rank batch size.
        num_workers: DataLoader workers per rank (default: see above).
        pin_memory: default ``True`` when the Trainer's device is CUDA.
        persistent_workers: default ``num_workers > 0``.
        prefetch_factor: batches prefetched per worker (default 4; ignored without workers).
        drop_last: drop the ragged last training batch.
    """

    def __init__(
        self,
        *,
        train: str | os.PathLike | None = None,
        val: str | os.PathLike | None = None,
        seq_len: int | None = None,
        batch_size: int = 32,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int = 4,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        if train is None and val is None:
            raise ValueError("MemmapDataModule: pass train=... and/or val=... (folders written by pack_memmap)")
        check_int("MemmapDataModule", "batch_size", batch_size)
        check_int("MemmapDataModule", "num_workers", num_workers, minimum=0, optional=True)
        check_int("MemmapDataModule", "prefetch_factor", prefetch_factor, unit="batches per worker")
        self.train_path, self.val_path, self.seq_len = train, val, seq_len
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.persistent_workers, self.prefetch_factor, self.drop_last = persistent_workers, prefetch_factor, drop_last
        self.datasets: dict[str, Dataset] = {}

    def _dataset(self, path: str | os.PathLike) -> Dataset:
        kind = read_memmap_index(path)["kind"]
        if kind == "tokens":
            if self.seq_len is None:
                raise ValueError(f"MemmapDataModule: {path} holds tokens; pass seq_len=...")
            return TokenMemmapDataset(path, self.seq_len)
        return MemmapDataset(path)

    @override
    def setup(self, stage: str) -> None:
        for split, path in (("train", self.train_path), ("val", self.val_path)):
            if path is not None and split not in self.datasets:
                self.datasets[split] = self._dataset(path)

    @override
    def teardown(self, stage: str) -> None:
        finish_collectives_at_teardown(self, self.trainer)

    def loader_settings(self) -> dict[str, Any]:
        """The DataLoader keyword arguments this module uses (resolved against the attached Trainer)."""
        trainer = getattr(self, "trainer", None)
        on_cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        local_ranks = trainer.num_devices if trainer is not None else 1
        workers = self.num_workers if self.num_workers is not None else default_num_workers(local_ranks)
        settings: dict[str, Any] = {
            "batch_size": self.batch_size,
            "num_workers": workers,
            "pin_memory": self.pin_memory if self.pin_memory is not None else on_cuda,
        }
        if workers > 0:
            settings["persistent_workers"] = self.persistent_workers if self.persistent_workers is not None else True
            settings["prefetch_factor"] = self.prefetch_factor
        return settings

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.datasets:
            self.setup("fit")
        if split not in self.datasets:
            raise ValueError(f"MemmapDataModule: no {split}=... folder was given")
        return DataLoader(
            self.datasets[split], shuffle=train, drop_last=train and self.drop_last, **self.loader_settings()
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    @override
    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", False) if self.val_path is not None else []
