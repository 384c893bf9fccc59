"""Prefetching iterable: fetch the next batches in a background thread and, on CUDA, copy them on a side stream.

:class:`PrefetchingLoader` wraps any iterable of batches; its batches, their order and the loader's randomness are
those of the wrapped loader. The thread, the side stream, what is read ahead and what is forwarded:
``docs/techniques/prefetch.md``, "Inside `PrefetchingLoader`".
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from lightning_accel._checks import check_int
from lightning_accel.core.batch import map_tensors

__all__ = ["CudaTransfer", "PrefetchIterator", "PrefetchingLoader"]

_BATCH, _END, _ERROR, _LENGTH = "batch", "end", "error", "length"
_POLL_S = 0.05  # how often a blocked producer re-checks the stop flag
# A stateful loader's (torchdata StatefulDataLoader) state counts the batches fetched ahead as consumed; forwarding
# it would make a mid-epoch resume skip them. Without these, Lightning treats the loader as not stateful. A loader
# whose state counts only the batches the training step consumed (``state_counts_trained_batches = True``, e.g.
# DALIImageDataModule's, which asks the fit loop) is forwarded.
_NOT_FORWARDED = frozenset({"state_dict", "load_state_dict"})


class CudaTransfer:
    """Copies batches host→device on a side CUDA stream (producer side) and hands them to the compute stream.

    Args:
        device: the CUDA device to copy to.
        pin_memory: pin host tensors that are not pinned yet before copying (pinned memory is what lets the copy
            run asynchronously with ``non_blocking=True``; from pageable memory the copy is synchronous).
    """

    def __init__(self, device: torch.device, *, pin_memory: bool = True) -> None:
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.stream = torch.cuda.Stream(device=self.device)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device.type and (
            self.device.index is None or tensor.device.index == self.device.index
        )

    def copy(self, batch: Any) -> tuple[Any, Any, list[torch.Tensor]]:
        """Start copying ``batch``; returns ``(device_batch, ready_event, copied_tensors)``. Runs in the producer."""
        copied: list[torch.Tensor] = []

        def move(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type != "cpu" or self._on_device(tensor):
                return tensor  # already on a device (e.g. DALI GPU output): untouched
            if self.pin_memory and not tensor.is_pinned():
                tensor = tensor.pin_memory()
            out = tensor.to(self.device, non_blocking=True)
            copied.append(out)
            return out

        # the producer thread's current device is not the trainer's (it is per thread): set both device and stream
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            moved = map_tensors(batch, move)
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event, copied

    def ready(self, moved: Any, event: Any, copied: list[torch.Tensor]) -> Any:
        """Make the consumer's current stream wait for the copy and keep the allocator safe; returns the batch."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in copied:
            # the memory was allocated on the side stream; without this the allocator could reuse it for the next
            # copy while the compute stream still reads it
            tensor.record_stream(current)
        return moved


def _put(q: queue.Queue[tuple[str, Any]], item: tuple[str, Any], stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(
    source: Iterator[Any],
    q: queue.Queue[tuple[str, Any]],
    stop: threading.Event,
    transfer: CudaTransfer | None,
    remaining: int | None,
) -> None:
    # Holds no reference to the PrefetchIterator, so dropping that object stops this thread (via __del__).
    try:
        while not stop.is_set():
            if remaining is not None and remaining <= 0:
                # the loader's length reached: the next() that would find the end is the consumer's to make
                _put(q, (_LENGTH, None), stop)
                return
            try:
                batch = next(source)
                remaining = None if remaining is None else remaining - 1
            except StopIteration:
                _put(q, (_END, None), stop)
                return
            item = transfer.copy(batch) if transfer is not None else batch
            if not _put(q, (_BATCH, item), stop):
                return
    except BaseException as err:  # noqa: BLE001 - re-raised in the consumer with its traceback
        _put(q, (_ERROR, err), stop)
    finally:
        del source


class PrefetchIterator(Iterator[Any]):
    """One pass over a :class:`PrefetchingLoader`; see docs/techniques/prefetch.md (Inside PrefetchingLoader)."""

    def __init__(
        self, iterable: Iterable[Any], depth: int, transfer: CudaTransfer | None, length: int | None = None
    ) -> None:
        self._transfer = transfer
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False
        self._first: tuple[str, Any] | None
        # iter() and the first batch in the caller's thread: docs/techniques/prefetch.md says why (order and randomness)
        source = iter(iterable)
        self._source: Iterator[Any] | None = source
        if length is not None and length <= 0:  # nothing to read ahead: the caller's next() looks for the end
            self._first = (_LENGTH, None)
            return
        try:
            first = next(source)
            self._first = (_BATCH, transfer.copy(first) if transfer is not None else first)
        except StopIteration:
            self._first = (_END, None)
            return
        except Exception as err:  # noqa: BLE001 - delivered by the first next(), like an un-wrapped loader would
            self._first = (_ERROR, err)
            return
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._queue, self._stop, transfer, None if length is None else length - 1),
            name="lightning-accel-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> PrefetchIterator:
        return self

    def _get(self) -> tuple[str, Any]:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    if not self._queue.empty():
                        continue
                    return (_ERROR, RuntimeError("the prefetch thread ended without delivering a batch or an error"))

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        kind, value = self._get()
        if kind == _LENGTH:
            # Past the loader's length the wrapped iterator is asked here, in the caller's thread, only when the
            # caller asks: a loop that stops at len() (Lightning's does) never makes that call, and the sampler's
            # exhausting step (a DataLoader's RandomSampler draws the next permutation from its generator there)
            # happens exactly where an un-wrapped loop would make it.
            self._first = (_LENGTH, None)
            try:
                batch = next(cast(Iterator[Any], self._source))
            except StopIteration:
                kind, value = _END, None
            except Exception as err:  # noqa: BLE001 - the loader's own, as from an un-wrapped loader
                kind, value = _ERROR, err
            else:
                return self._transfer.ready(*self._transfer.copy(batch)) if self._transfer is not None else batch
        if kind == _BATCH:
            return self._transfer.ready(*value) if self._transfer is not None else value
        self.close()
        if kind == _END:
            raise StopIteration
        raise value  # the loader's own exception; its __traceback__ still holds the loader's frames

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the producer thread and drop the batches it had fetched ahead."""
        self._done = True
        self._first = None
        self._source = None
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue and free the batches held
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread is not None and self._thread.is_alive()

    def __del__(self) -> None:
        # No join here: __del__ may run in any thread, at any time; the thread exits within _POLL_S.
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


class PrefetchingLoader:
    """Wraps an iterable of batches so the next ``depth`` batches are fetched (and, on CUDA, copied) ahead.

    Args:
        loader: what to wrap: anything iterable, re-iterable for several epochs (a ``DataLoader``).
        depth: batches kept ready (queue size; the thread may hold one more while it waits for room). Each batch
            held ahead costs its memory (host, or device for CUDA); 2 absorbs one slow batch without stalling.
        device: the CUDA device to copy batches to; ``None`` or a CPU device prefetches on the host only.
        pin_memory: pin host tensors before a CUDA copy (default: on for CUDA). Ignored on CPU.

    Raises:
        ValueError: ``depth`` is not a positive int, or ``loader`` is not iterable.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        depth: int = 2,
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        check_int("PrefetchingLoader", "depth", depth, unit="batches", example=2)
        if not hasattr(loader, "__iter__"):
            raise ValueError(
                f"PrefetchingLoader: expected an iterable of batches (e.g. a DataLoader), got {type(loader).__name__}"
            )
        device = torch.device(device) if device is not None else None
        if device is not None and device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"PrefetchingLoader(device={str(device)!r}): only 'cpu' and 'cuda' devices are "
                "supported; pass device=None to prefetch on the host only"
            )
        object.__setattr__(self, "_prefetch_loader", loader)
        object.__setattr__(self, "_prefetch_depth", depth)
        object.__setattr__(self, "_prefetch_device", device)
        object.__setattr__(self, "_prefetch_pin", True if pin_memory is None else bool(pin_memory))
        object.__setattr__(self, "_prefetch_transfer", None)
        object.__setattr__(self, "_prefetch_iterators", weakref.WeakSet())
        object.__setattr__(self, "_prefetch_threads", [])

    @property
    def loader(self) -> Iterable[Any]:
        """The wrapped loader."""
        return cast(Iterable[Any], self._prefetch_loader)

    @property
    def depth(self) -> int:
        """Batches fetched ahead."""
        return int(self._prefetch_depth)

    @property
    def device(self) -> torch.device | None:
        """The CUDA device batches are copied to, or ``None`` (host-only prefetching)."""
        return (
            self._prefetch_device
            if self._prefetch_device is not None and self._prefetch_device.type == "cuda"
            else None
        )

    def __iter__(self) -> PrefetchIterator:
        # a new pass ends the passes before it first: their producer threads may still be inside the wrapped
        # loader's iterator, which a new iter() resets (persistent workers: the same iterator object) or forks
        # new workers beside (a fork while another thread runs the loader hung once in a 2-process DDP test)
        self.close()
        transfer = None
        if self.device is not None:
            if self._prefetch_transfer is None:  # one side stream per loader, created lazily (no CUDA at init)
                object.__setattr__(self, "_prefetch_transfer", CudaTransfer(self.device, pin_memory=self._prefetch_pin))
            transfer = self._prefetch_transfer
        try:  # as Lightning reads it (``sized_len``): a loop over a sized loader stops at its length
            length: int | None = len(self._prefetch_loader)
        except (TypeError, NotImplementedError):
            length = None
        iterator = PrefetchIterator(self._prefetch_loader, self._prefetch_depth, transfer, length)
        self._prefetch_iterators.add(iterator)
        # threads of passes abandoned without close() (e.g. Lightning's limit_train_batches) end on their own
        # after garbage collection; keep them too, so close() can wait for them
        self._prefetch_threads[:] = [(stop, t) for stop, t in self._prefetch_threads if t.is_alive()]
        if iterator._thread is not None:
            self._prefetch_threads.append((iterator._stop, iterator._thread))
        return iterator

    def __len__(self) -> int:
        return len(self._prefetch_loader)  # a TypeError for an unsized loader, as len() gives

    def close(self) -> None:
        """Stop every running pass over this loader and wait for its thread to end."""
        for iterator in list(self._prefetch_iterators):
            iterator.close()
        for stop, _thread in self._prefetch_threads:
            stop.set()
        for _, thread in self._prefetch_threads:
            thread.join(timeout=5.0)
        self._prefetch_threads.clear()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_prefetch_"):  # not set yet (copy/unpickle): no recursion into the wrapped loader
            raise AttributeError(name)
        if name == "_iterator":
            # a DataLoader's persistent-worker iterator: Lightning's teardown shuts its workers down through this
            # attribute (``_shutdown_workers_and_reset_iterator``) while our producer thread may be blocked inside
            # it, which would then wait forever. The producer owns that iterator: close() stops it first, and the
            # DataLoader shuts its own workers down when it goes away.
            raise AttributeError(name)
        if name in _NOT_FORWARDED and not getattr(self._prefetch_loader, "state_counts_trained_batches", False):
            raise AttributeError(
                f"PrefetchingLoader does not forward {name!r}: the wrapped loader has already "
                "produced the batches fetched ahead, so its state would skip them on resume"
            )
        return getattr(self._prefetch_loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_prefetch_") or name in type(self).__dict__:
            object.__setattr__(self, name, value)
        else:  # e.g. Lightning setting ``worker_init_fn`` or resetting ``_iterator`` on the DataLoader
            setattr(self._prefetch_loader, name, value)

    def __repr__(self) -> str:
        where = f", device={self.device}" if self.device is not None else ""
        return f"PrefetchingLoader({self._prefetch_loader!r}, depth={self._prefetch_depth}{where})"
