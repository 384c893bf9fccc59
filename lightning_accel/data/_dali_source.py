"""What feeds DALI's ``fn.external_source``: the encoded bytes of an epoch plan's batches, read in Python so a corrupt
or missing file is named (DALI's own decode error does not say which file failed) and, with ``skip_corrupt``,
replaced by the next good image of the same source."""

from __future__ import annotations

import io
import warnings
from collections import deque
from typing import Any

import numpy as np

from lightning_accel.data.image_index import CorruptImageError, ImageIndex, sniff_image_format

__all__ = ["_BatchSource"]


class _BatchSource:
    """The ``fn.external_source`` callback: reads the encoded bytes of the epoch plan's batches, in order.

    Remembers the batches handed to DALI but not yet consumed (DALI runs ``prefetch_queue_depth`` batches ahead),
    so a decode failure can be traced to the files that were in flight.
    """

    def __init__(self, index: ImageIndex, *, skip_corrupt: bool) -> None:
        self.index = index
        self.skip_corrupt = skip_corrupt
        self.bad: dict[int, str] = {}  # sample -> reason; substituted when read
        self.substitutions = 0
        self._plan: list[np.ndarray] = []
        self._next = 0
        self._stop = False
        self.inflight: deque[tuple[int, list[int]]] = deque()

    def start_epoch(self, plan: list[np.ndarray]) -> None:
        self._plan, self._next, self._stop = plan, 0, False
        self.inflight.clear()

    def stop(self) -> None:
        """End the epoch early (the consumer stopped): the next call raises StopIteration."""
        self._stop = True

    def rewind(self) -> None:
        """Feed again from the oldest batch not yet consumed (after a pipeline rebuild)."""
        if self.inflight:
            self._next = self.inflight[0][0]
        self.inflight.clear()
        self._stop = False

    def mark_bad(self, sample: int, reason: str) -> None:
        if sample not in self.bad:
            self.bad[sample] = reason
            warnings.warn(
                f"DALIImageDataModule: skipping corrupt image {self.index.names[sample]} ({reason}); "
                f"it is replaced by another image of the same source",
                stacklevel=2,
            )

    def _read_checked(self, sample: int) -> tuple[bytes | None, str]:
        try:
            data = self.index.read(sample)
        except (OSError, CorruptImageError) as err:
            if isinstance(err, FileNotFoundError) and not self.skip_corrupt:
                raise FileNotFoundError(f"image file {self.index.names[sample]} is missing ({err})") from err
            return None, f"cannot read: {err}"
        if sniff_image_format(data) is None:
            return None, f"not an image: {len(data)} bytes starting {data[:8]!r}"
        return data, ""

    def _read(self, sample: int) -> tuple[bytes, int]:
        n = len(self.index)
        for attempt in range(n):
            candidate = (sample + attempt) % n  # a bad sample is replaced by the next good one (deterministic)
            if candidate in self.bad:
                continue
            data, reason = self._read_checked(candidate)
            if data is not None:
                if attempt:
                    self.substitutions += 1
                return data, candidate
            if not self.skip_corrupt:
                raise CorruptImageError(
                    f"{self.index.names[candidate]}: {reason}. Remove or replace the file, or "
                    f"pass skip_corrupt=True to skip such files",
                    [self.index.names[candidate]],
                )
            self.mark_bad(candidate, reason)
        raise CorruptImageError(f"no readable image left in {self.index.description}", [])

    def __call__(self, info: Any = None) -> tuple[list[np.ndarray], np.ndarray]:
        if self._stop or self._next >= len(self._plan):
            raise StopIteration
        position = self._next
        self._next += 1
        datas: list[np.ndarray] = []
        used: list[int] = []
        for sample in self._plan[position]:
            data, actual = self._read(int(sample))
            datas.append(np.frombuffer(data, dtype=np.uint8))
            used.append(actual)
        self.inflight.append((position, used))
        return datas, self.index.labels[used].astype(np.int32)

    def find_undecodable(self) -> dict[int, str]:
        """Decode every in-flight image with PIL; the ones that fail, with PIL's message."""
        from PIL import Image

        found: dict[int, str] = {}
        for _, samples in self.inflight:
            for sample in samples:
                try:
                    with Image.open(io.BytesIO(self.index.read(sample))) as img:
                        img.load()
                except Exception as err:  # noqa: BLE001 - any decoder error means the file is the culprit
                    found[sample] = f"{type(err).__name__}: {err}"
        return found
