"""The DALI loader of one split: an iterable of ``(images, labels)`` torch batches over a DALI pipeline that the data
module (:class:`~lightning_accel.data.dali.DALIImageDataModule`) builds, with the epoch plan, the mid-epoch resume
state and the recovery from an undecodable file."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from lightning_accel._imports import require
from lightning_accel.data._dali_source import _BatchSource
from lightning_accel.data.image_index import CorruptImageError, ImageIndex
from lightning_accel.data.sharding import epoch_plan, num_batches

if TYPE_CHECKING:
    from types import ModuleType

    import lightning.pytorch as pl

__all__ = ["_DALILoader", "_dali"]


class _LoaderOwner(Protocol):
    """What a loader reads of the data module that owns it (``DALIImageDataModule``)."""

    last_batch: str
    skip_corrupt: bool
    seed: int
    shuffle: bool

    @property
    def pipeline_settings(self) -> dict[str, Any]: ...

    def _trainer_or_none(self) -> pl.Trainer | None: ...

    #: builds the split's DALI pipeline: ``(source, *, train, batch_size, decode_device, device_id, seed, dali)``
    _pipeline: Callable[..., Any]


def _dali() -> ModuleType:
    return require("nvidia.dali", "DALIImageDataModule")


class _DALILoader:
    """An iterable of ``(images, labels)`` torch batches for one split; ``len()`` is the batches per rank."""

    def __init__(
        self,
        module: _LoaderOwner,
        index: ImageIndex,
        *,
        train: bool,
        batch_size: int,
        rank: int,
        world_size: int,
        decode_device: str,
        device_id: int | None,
        epoch_fn: Callable[[], int],
    ) -> None:
        self.module, self.index, self.train = module, index, train
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.decode_device, self.device_id, self.epoch_fn = decode_device, device_id, epoch_fn
        self.last_batch = module.last_batch if train else "partial"
        self.source = _BatchSource(index, skip_corrupt=module.skip_corrupt)
        self._pipe: Any = None
        self._iter: Any = None
        self._open = False  # an epoch was started and not run to its end
        self._len = num_batches(len(index), batch_size=batch_size, world_size=world_size, last_batch=self.last_batch)
        self._epoch: int | None = None  # the epoch last started, and the batches of it handed out (or skipped)
        self._yielded = 0
        self._resume: dict[str, Any] | None = None  # a checkpoint's position, applied when its epoch starts

    #: the resume state counts the batches the training step consumed (the fit loop's count), not those fetched
    #: ahead, so a prefetching wrapper (``DevicePrefetcher``) may forward it
    state_counts_trained_batches = True

    def __len__(self) -> int:
        return self._len

    @property
    def dataset(self) -> ImageIndex:
        """The samples (sized), like a DataLoader's ``dataset``: what ``BatchSizeTuner`` caps the batch size by."""
        return self.index

    @property
    def pipeline_settings(self) -> dict[str, Any]:
        """What ``BottleneckDoctor`` reads to name this pipeline's own knobs in its data finding."""
        return {**self.module.pipeline_settings, "decode_device": self.decode_device}

    # ------------------------------------------------------------------ mid-epoch resume (Lightning's _Stateful)
    def _batches_done(self) -> int:
        """Batches of the current epoch whose training step has run.

        Under a Trainer this is the fit loop's ``batch_progress.current.processed``, the count Lightning itself
        resumes from; it is one less than the batches handed out when a checkpoint is written because a
        training step raised (``OnExceptionCheckpoint``), and the resumed run must see that batch again.
        Outside a Trainer, the batches handed out.
        """
        trainer = self.module._trainer_or_none()
        fitting = trainer is not None and getattr(trainer.state, "fn", None) == "fit"  # TrainerFn.FITTING
        if self.train and fitting and trainer.current_epoch == self._epoch:
            return min(int(trainer.fit_loop.epoch_loop.batch_progress.current.processed), self._yielded)
        return self._yielded

    def _order(self) -> dict[str, Any]:
        """What an epoch's global order depends on (besides the epoch): equal orders map positions exactly."""
        return {
            "num_samples": len(self.index),
            "seed": self.module.seed,
            "shuffle": self.shuffle,
            "last_batch": self.last_batch,
        }

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch, saved in Lightning checkpoints so that a mid-epoch resume sees only unseen
        samples. Positions count samples of the epoch's global shuffled order, which depends on the seed, the
        epoch and the number of samples only, so a resume with another world size or batch size stays exact."""
        if self._epoch is None:
            return {}
        return {
            "epoch": self._epoch,
            "samples_done": self._batches_done() * self.batch_size * self.world_size,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            **self._order(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = {"epoch", "samples_done", "batch_size", "world_size", *self._order()}  # what state_dict writes
        missing = sorted(keys - set(state or {}))
        if state and missing:
            warnings.warn(
                f"DALIImageDataModule: the checkpoint's loader state lacks {missing} (written by another "
                f"loader or version), so the interrupted epoch is read from its start",
                stacklevel=2,
            )
        self._resume = dict(state) if state and not missing else None

    def _resume_skip(self, epoch: int) -> int:
        """Batches of ``epoch``'s plan a loaded checkpoint has already trained on (consumes the checkpoint)."""
        state, self._resume = self._resume, None
        if state is None or state.get("epoch") != epoch:
            return 0  # the checkpoint ended its epoch (or was taken outside one): start the epoch afresh
        now = self._order()
        then = {key: state[key] for key in now}
        if then != now:
            warnings.warn(
                f"DALIImageDataModule: the checkpoint was taken mid-epoch with other data or settings "
                f"({then}; now {now}), so its position cannot be mapped: epoch {epoch} is read from its "
                f"start",
                stacklevel=3,
            )
            return 0
        done, per_batch = int(state["samples_done"]), self.batch_size * self.world_size
        skip = -(-done // per_batch)  # ceil: never show a sample twice in one epoch
        if skip * per_batch != done:
            warnings.warn(
                f"DALIImageDataModule: resuming epoch {epoch} with {self.world_size} rank(s) x batch "
                f"{self.batch_size} from a checkpoint taken with {state['world_size']} x "
                f"{state['batch_size']}: {skip * per_batch - done} sample(s) of this epoch are skipped "
                f"so that none is seen twice",
                stacklevel=3,
            )
        return min(skip, self._len)

    @property
    def shuffle(self) -> bool:
        return self.train and self.module.shuffle

    def plan(self, epoch: int) -> list[np.ndarray]:
        return epoch_plan(
            len(self.index),
            batch_size=self.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            seed=self.module.seed,
            epoch=epoch,
            last_batch=self.last_batch,
        )

    def _build(self) -> None:
        dali = _dali()
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        pipe = self.module._pipeline(
            self.source,
            train=self.train,
            batch_size=self.batch_size,
            decode_device=self.decode_device,
            device_id=self.device_id,
            seed=self.module.seed + 7919 * self.rank,
            dali=dali,
        )
        # size=-1: the epoch ends when the source raises StopIteration (the plan decides the batch count)
        self._iter = DALIGenericIterator(pipe, ["images", "labels"], auto_reset=False, prepare_first_batch=False)
        self._pipe = pipe

    def _discard(self) -> None:
        self._iter = self._pipe = None
        self._open = False

    def close(self) -> None:
        self._discard()
        self.index.close()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._open and self._iter is not None:
            self._drain()
        epoch = self.epoch_fn()
        skip = self._resume_skip(epoch) if self._resume is not None else 0
        self._epoch, self._yielded = epoch, skip
        self.source.start_epoch(self.plan(epoch)[skip:])
        if self._iter is None:
            self._build()
        else:
            self._iter.reset()
        self._open = True
        while True:
            try:
                out = next(self._iter)
            except StopIteration:
                self._open = False
                return
            except RuntimeError as err:  # DALI's error for a failed decode names no file: find it
                self._recover(err)
                continue
            except BaseException:  # e.g. CorruptImageError from the source: a pipeline that raised is not reused
                self._discard()
                raise
            self.source.inflight.popleft()
            self._yielded += 1
            images, labels = out[0]["images"], out[0]["labels"]
            yield images, labels.reshape(-1).long()

    def _drain(self) -> None:
        """The last epoch was cut short (``limit_*_batches``, ``max_steps``): consume what DALI has in flight.

        At most ``prefetch_queue_depth`` batches, already being decoded; ``next`` rather than ``iter``, since the
        DALI iterator's ``__iter__`` would reset the pipeline with those batches still queued.
        """
        self.source.stop()
        try:
            while True:
                next(self._iter)
        except StopIteration:
            self._open = False
        except Exception:  # noqa: BLE001 - a corrupt image among the abandoned batches: start the next epoch on a new pipeline
            self._discard()

    def _recover(self, err: RuntimeError) -> None:
        """A DALI error mid-epoch: name the undecodable file(s); skip them and rebuild if ``skip_corrupt``."""
        culprits = self.source.find_undecodable()
        if not culprits:
            names = [self.index.names[s] for _, batch in self.source.inflight for s in batch]
            self._discard()
            raise RuntimeError(
                f"DALI failed while processing a batch from {self.index.description}; every image "
                f"in flight decodes with PIL, so the cause is not a corrupt file. Images in flight: "
                f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            ) from err
        names = [f"{self.index.names[s]} ({reason})" for s, reason in culprits.items()]
        if not self.source.skip_corrupt:
            self._discard()  # a pipeline that raised cannot be reused
            raise CorruptImageError(
                f"corrupt image(s) that cannot be decoded: {'; '.join(names)}. Remove or "
                f"replace them, or pass skip_corrupt=True to skip them",
                [self.index.names[s] for s in culprits],
            ) from err
        for sample, reason in culprits.items():
            self.source.mark_bad(sample, reason)
        self.source.rewind()
        self._build()
