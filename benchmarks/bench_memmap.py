"""MemmapDataset vs one ``.npy`` file per sample, side by side through the same DataLoader.

The same samples (CIFAR-sized ``3x32x32`` uint8 by default) are stored both ways: ``N`` per-file ``.npy`` (read with
``np.load`` per sample, the common "preprocessed to files" layout) and ``pack_memmap`` shards (read with
``MemmapDataset``, whose ``__getitems__`` fetches a batch with one sorted fancy index per shard). Both go through
``DataLoader(shuffle=True, batch_size=256, num_workers=W)``; epochs alternate (A B A B ...) after a warm-up epoch,
and the table reports the median samples/s. Files are in the page cache for both (a cold cache only widens the gap).

    flock /tmp/la-bench.lock python benchmarks/bench_memmap.py [--samples 20000] [--workers 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class NpyFiles(Dataset):
    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.load(self.files[i]))


def epoch_rate(loader) -> float:
    start = time.perf_counter()
    n = 0
    for batch in loader:
        n += batch.shape[0]
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--shape", type=int, nargs="+", default=[3, 32, 32])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lightning_accel.data.memmap import MemmapDataset, pack_memmap

    data = np.random.default_rng(0).integers(0, 256, size=(args.samples, *args.shape), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, sample in enumerate(data):
            path = Path(tmp) / "npy" / f"{i // 1000:03d}" / f"{i:07d}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, sample)
            files.append(path)
        pack_memmap(data, Path(tmp) / "packed", progress_bar=False)
        loaders = {}
        for name, dataset in (("npy", NpyFiles(files)), ("memmap", MemmapDataset(Path(tmp) / "packed"))):
            kwargs = {"persistent_workers": True, "prefetch_factor": 4} if args.workers else {}
            loaders[name] = DataLoader(
                dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, **kwargs
            )
            epoch_rate(loaders[name])  # warm-up: worker start-up, page cache
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(args.rounds):
            for name, loader in loaders.items():
                rates[name].append(epoch_rate(loader))
        npy, mm = statistics.median(rates["npy"]), statistics.median(rates["memmap"])
        print(
            f"{args.samples} samples {tuple(args.shape)} uint8, batch {args.batch_size}, shuffled, "
            f"{args.workers} DataLoader workers, median of {args.rounds} alternating epochs"
        )
        print("| dataset | samples/s | ratio |\n|---|---|---|")
        print(f"| one .npy file per sample (np.load) | {npy:,.0f} | 1.00x |")
        print(f"| MemmapDataset (pack_memmap shards) | {mm:,.0f} | {mm / npy:.1f}x |")
        print(f"all rounds: npy {[round(r) for r in rates['npy']]}, memmap {[round(r) for r in rates['memmap']]}")


if __name__ == "__main__":
    main()
