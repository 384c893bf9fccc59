"""Encoded-image sources as one flat, random-access table: ImageFolder trees, file lists, WebDataset tar shards.

Every source becomes an :class:`ImageIndex`: for sample ``i``, the file that holds its bytes, the byte range in that
file (a whole file, or one member of an uncompressed tar) and its integer label. Readers then need nothing but
``pread``; a failure always names the file (``shard-000003.tar:00001234.jpg`` for a tar member).
"""

from __future__ import annotations

import glob
import json
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageIndex",
    "ImageSource",
    "CorruptImageError",
    "resolve_image_source",
    "sniff_image_format",
]

#: extensions DALI's image decoders read (``fn.decoders.image``: JPEG, JPEG 2000, PNG, BMP, TIFF, PNM, WebP)
IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".tif",
    ".tiff",
    ".webp",
    ".pnm",
    ".ppm",
    ".pgm",
    ".pbm",
    ".jp2",
    ".j2k",
)
#: label member of a WebDataset sample (``key.cls`` holds the class index as ASCII), the WebDataset convention
LABEL_EXTENSION = "cls"
#: the class-index file written by :func:`lightning_accel.data.webdataset.pack_webdataset` next to the shards
CLASSES_FILE = "classes.json"

ImageSource = str | os.PathLike | Sequence


class CorruptImageError(ValueError):
    """An image file that cannot be decoded; ``files`` names every culprit found."""

    def __init__(self, message: str, files: Sequence[str]) -> None:
        super().__init__(message)
        self.files = list(files)


def sniff_image_format(data: bytes) -> str | None:
    """The image format from the first bytes of ``data`` (magic numbers), or ``None`` if it is not an image."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or data[:4] == b"\xffO\xffQ":
        return "jpeg2000"
    if len(data) > 2 and data[:1] == b"P" and data[1:2] in b"123456" and data[2:3].isspace():
        return "pnm"
    return None


@dataclass
class ImageIndex:
    """Samples as parallel arrays: file of each sample, byte offset and length (-1: whole file), label."""

    files: list[str]
    file_ids: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    labels: np.ndarray
    names: list[str]
    classes: list[str] | None = None
    description: str = ""
    _handles: dict[int, int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}  # file descriptors do not cross processes

    def read(self, i: int) -> bytes:
        """The encoded bytes of sample ``i``; a missing file raises FileNotFoundError naming it."""
        fid = int(self.file_ids[i])
        size = int(self.sizes[i])
        path = self.files[fid]
        if size < 0:
            with open(path, "rb") as f:
                return f.read()
        fd = self._handles.get(fid)
        if fd is None:
            fd = self._handles[fid] = os.open(path, os.O_RDONLY)
        data = os.pread(fd, size, int(self.offsets[i]))
        if len(data) != size:
            raise CorruptImageError(
                f"{self.names[i]}: expected {size} bytes at offset {int(self.offsets[i])}, "
                f"read {len(data)}: the shard {path} is truncated",
                [self.names[i]],
            )
        return data

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _from_lists(
    files: list[str],
    file_ids: list[int],
    offsets: list[int],
    sizes: list[int],
    labels: list[int],
    names: list[str],
    classes: list[str] | None,
    description: str,
) -> ImageIndex:
    return ImageIndex(
        files=files,
        file_ids=np.asarray(file_ids, np.int64),
        offsets=np.asarray(offsets, np.int64),
        sizes=np.asarray(sizes, np.int64),
        labels=np.asarray(labels, np.int64),
        names=names,
        classes=classes,
        description=description,
    )


def index_image_folder(root: str | os.PathLike) -> ImageIndex:
    """``root/<class>/**/<image>``: classes are the sorted sub-folder names (as torchvision's ``ImageFolder``).

    Files whose extension is not one of :data:`IMAGE_EXTENSIONS` (and hidden files) are ignored; a class folder
    with no image is an error, since its label would silently never occur.
    """
    root = Path(root)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(
            f"{root} has no class sub-folders: expected an ImageFolder layout "
            f"{root}/<class name>/<image>.jpg, WebDataset .tar shards, or a file list"
        )
    files: list[str] = []
    names: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        found = 0
        for dirpath, dirnames, filenames in os.walk(root / cls):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith(".") or not name.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                path = os.path.join(dirpath, name)
                files.append(path)
                names.append(os.path.relpath(path, root))
                labels.append(label)
                found += 1
        if not found:
            raise FileNotFoundError(
                f"class folder {root / cls} has no image files (extensions "
                f"{', '.join(IMAGE_EXTENSIONS)}): remove it or add its images"
            )
    n = len(files)
    return _from_lists(
        files,
        list(range(n)),
        [0] * n,
        [-1] * n,
        labels,
        names,
        classes,
        f"ImageFolder {root} ({n} images, {len(classes)} classes)",
    )


def index_file_list(
    entries: str | os.PathLike | Sequence[tuple[str, int]], root: str | os.PathLike | None = None
) -> ImageIndex:
    """A text file of ``<path> <label>`` lines (DALI's ``file_list`` format) or a sequence of ``(path, label)``.

    Relative paths are taken from ``root``, by default the folder holding the list file (DALI's convention).
    """
    if isinstance(entries, (str, os.PathLike)):
        list_path = Path(entries)
        base = Path(root) if root is not None else list_path.parent
        pairs: list[tuple[str, int]] = []
        for lineno, line in enumerate(list_path.read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            path, _, label = line.strip().rpartition(" ")
            try:
                pairs.append((path.strip(), int(label)))
            except ValueError:
                raise ValueError(f"{list_path}:{lineno}: expected '<path> <integer label>', got {line!r}") from None
        description = f"file list {list_path}"
    else:
        base = Path(root) if root is not None else Path.cwd()
        pairs = [(str(p), int(lbl)) for p, lbl in entries]
        description = "file list"
    if not pairs:
        raise ValueError(f"{description} has no entries")
    files = [str(base / p) for p, _ in pairs]
    n = len(files)
    return _from_lists(
        files,
        list(range(n)),
        [0] * n,
        [-1] * n,
        [lbl for _, lbl in pairs],
        [p for p, _ in pairs],
        None,
        f"{description} ({n} images)",
    )


def _split_key(member_name: str) -> tuple[str, str]:
    # WebDataset convention: the key is the path up to the first dot of the base name; the rest is the extension
    directory, base = os.path.split(member_name)
    stem, _, ext = base.partition(".")
    return os.path.join(directory, stem), ext.lower()


def index_webdataset(shards: Sequence[str | os.PathLike]) -> ImageIndex:
    """Uncompressed WebDataset ``.tar`` shards: per sample key an image member and a ``.cls`` label member.

    Reads only the tar headers and the tiny ``.cls`` members; images are later read by offset. ``classes.json``
    next to the first shard (written by ``pack_webdataset``) gives the class names.
    """
    files = [str(s) for s in shards]
    if not files:
        raise FileNotFoundError("no WebDataset .tar shards given")
    file_ids: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    labels: list[int] = []
    names: list[str] = []
    for fid, path in enumerate(files):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"WebDataset shard {path} does not exist")
        try:
            tar = tarfile.open(path, "r:")  # uncompressed only: samples are read by offset
        except tarfile.ReadError as err:
            raise ValueError(
                f"{path} is not an uncompressed tar ({err}); compressed shards cannot be read by "
                f"offset: repack them with `lightning-accel pack webdataset`"
            ) from err
        with tar:
            samples: dict[str, dict[str, tarfile.TarInfo]] = {}
            for member in tar:
                if member.isfile():
                    key, ext = _split_key(member.name)
                    samples.setdefault(key, {})[ext] = member
            for key, members in samples.items():
                image = next((m for ext, m in members.items() if f".{ext}".endswith(IMAGE_EXTENSIONS)), None)
                if image is None:
                    continue  # a sample without an image (e.g. metadata only) is not an image sample
                if LABEL_EXTENSION not in members:
                    raise ValueError(f"{path}:{image.name} has no '{key}.{LABEL_EXTENSION}' label member")
                raw = tar.extractfile(members[LABEL_EXTENSION]).read()  # type: ignore[union-attr]
                try:
                    label = int(raw.decode().strip())
                except ValueError:
                    raise ValueError(
                        f"{path}:{key}.{LABEL_EXTENSION} holds {raw[:40]!r}, not an integer label"
                    ) from None
                file_ids.append(fid)
                offsets.append(image.offset_data)
                sizes.append(image.size)
                labels.append(label)
                names.append(f"{path}:{image.name}")
    if not labels:
        raise FileNotFoundError(
            f"no image samples (image member + .{LABEL_EXTENSION} label) in the shards "
            f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}"
        )
    classes = None
    classes_file = Path(files[0]).parent / CLASSES_FILE
    if classes_file.is_file():
        classes = list(json.loads(classes_file.read_text())["classes"])
    return _from_lists(
        files,
        file_ids,
        offsets,
        sizes,
        labels,
        names,
        classes,
        f"WebDataset ({len(files)} shards, {len(labels)} images)",
    )


def resolve_image_source(source: ImageSource) -> ImageIndex:
    """Index ``source``: a class-folder tree, ``.tar`` shard(s) (a folder of them, a glob, a list), a ``.txt``
    file list, or a sequence of ``(path, label)`` pairs."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if any(c in text for c in "*?["):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(f"no file matches {text!r}")
            return resolve_image_source(matches)
        path = Path(text)
        if not path.exists():
            raise FileNotFoundError(f"image source {path} does not exist")
        if path.is_dir():
            entries = [e for e in os.scandir(path) if not e.name.startswith(".")]
            if not entries:
                raise FileNotFoundError(
                    f"image folder {path} is empty: expected class sub-folders "
                    f"({path}/<class>/<image>.jpg) or WebDataset .tar shards"
                )
            if any(e.is_dir() for e in entries):
                return index_image_folder(path)
            tars = sorted(e.path for e in entries if e.name.endswith(".tar"))
            if tars:
                return index_webdataset(tars)
            raise FileNotFoundError(
                f"{path} has neither class sub-folders nor .tar shards (it holds "
                f"{', '.join(sorted(e.name for e in entries)[:5])} ...)"
            )
        if path.suffix == ".tar":
            return index_webdataset([path])
        return index_file_list(path)
    if isinstance(source, Sequence) and source:
        if all(isinstance(s, (str, os.PathLike)) for s in source):
            return index_webdataset(list(source))
        return index_file_list(source)
    raise ValueError(
        f"image source must be a folder, .tar shard(s), a file list or (path, label) pairs; got {source!r}"
    )
