"""``lightning-accel pack webdataset|memmap SRC OUT``: pack small files into large shards."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ORDER = 40


def _webdataset(args: argparse.Namespace) -> int:
    from lightning_accel.data.webdataset import pack_webdataset

    meta = pack_webdataset(
        args.src,
        args.out,
        shard_size=args.shard_size,
        shuffle=args.shuffle,
        seed=args.seed,
        prefix=args.prefix,
        progress_bar=args.progress_bar,
    )
    print(
        f"packed {meta['num_samples']} images of {len(meta['classes'])} classes into {len(meta['shards'])} "
        f"shard(s) in {args.out} (class index: {Path(args.out) / 'classes.json'})"
    )
    return 0


def _sources(src: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in src:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".npy", ".bin") and p.is_file())
            if not found:
                raise FileNotFoundError(f"{path} holds no .npy or .bin files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist")
    return files


def _memmap(args: argparse.Namespace) -> int:
    import numpy as np

    from lightning_accel.data.memmap import pack_memmap

    files = _sources(args.src)

    def load(path: Path) -> Any:
        if path.suffix == ".bin":
            if args.bin_dtype is None:
                raise ValueError(f"{path} is raw binary: pass --bin-dtype (e.g. uint16) to read it")
            return np.memmap(path, dtype=args.bin_dtype, mode="r")
        return np.load(path, mmap_mode="r")

    if args.kind == "tokens":
        data: Any = (np.asarray(load(p)).reshape(-1) for p in files)
    elif args.stacked:
        data = (sample for p in files for sample in load(p))
    else:
        data = (load(p) for p in files)
    labels = None
    if args.labels is not None:
        labels = np.load(args.labels)
    meta = pack_memmap(
        data,
        args.out,
        kind=args.kind,
        labels=labels,
        dtype=args.dtype,
        shard_bytes=int(args.shard_mib * 2**20),
        eos=args.eos,
        progress_bar=args.progress_bar,
    )
    count = meta["num_tokens"] if args.kind == "tokens" else meta["num_samples"]
    print(
        f"packed {count} {args.kind} ({meta['dtype']}) from {len(files)} file(s) into {len(meta['shards'])} "
        f"shard(s) in {args.out}"
    )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pack",
        help="pack small files into large shards (WebDataset tars, numpy memmap)",
        description="Pack many small files into a few large shards: sequential, page-cache friendly reads.",
    )
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")

    wds = formats.add_parser(
        "webdataset",
        help="ImageFolder tree -> WebDataset .tar shards + classes.json",
        description="Pack SRC/<class>/<image> into uncompressed WebDataset tar shards (members <key>.<ext> and "
        "<key>.cls) in OUT, with classes.json; shards are written atomically.",
    )
    wds.add_argument("src", help="ImageFolder root: one sub-folder per class")
    wds.add_argument("out", help="output folder for the shards")
    wds.add_argument("--shard-size", type=int, default=1000, help="images per shard (default %(default)s)")
    wds.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="keep class order (by default samples are shuffled across shards)",
    )
    wds.add_argument("--seed", type=int, default=0, help="seed of the shuffle (default %(default)s)")
    wds.add_argument("--prefix", default="shard", help="shard name prefix (default %(default)s)")
    wds.add_argument("--no-progress-bar", dest="progress_bar", action="store_false", help="hide the progress bar")
    wds.set_defaults(func=_webdataset)

    mm = formats.add_parser(
        "memmap",
        help=".npy/.bin files -> numpy memmap shards + index.json",
        description="Pack .npy files (or raw .bin token files) into .npy memmap shards with index.json, read by "
        "MemmapDataset (--kind samples) or TokenMemmapDataset (--kind tokens).",
    )
    mm.add_argument("src", nargs="+", help=".npy/.bin files or folders of them (sorted)")
    mm.add_argument("out", help="output folder")
    mm.add_argument(
        "--kind",
        choices=("samples", "tokens"),
        default="samples",
        help="samples: each .npy is one sample (or, with --stacked, an array of samples); tokens: each "
        "file is a 1-D document, concatenated (default %(default)s)",
    )
    mm.add_argument("--stacked", action="store_true", help="each .npy holds many samples along its first axis")
    mm.add_argument("--labels", default=None, help=".npy of integer labels, one per sample")
    mm.add_argument("--dtype", default=None, help="storage dtype (default: the input's; tokens: uint32)")
    mm.add_argument("--bin-dtype", default=None, help="dtype of raw .bin inputs (e.g. uint16)")
    mm.add_argument("--eos", type=int, default=None, help="token appended after every document (kind tokens)")
    mm.add_argument("--shard-mib", type=float, default=256, help="target shard size in MiB (default %(default)s)")
    mm.add_argument("--no-progress-bar", dest="progress_bar", action="store_false", help="hide the progress bar")
    mm.set_defaults(func=_memmap)
