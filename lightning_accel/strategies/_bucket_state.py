"""Per-bucket compressor state moved between DDP bucket layouts through per-parameter pieces.

A compressor keeps state per gradient bucket, keyed by DDP's bucket index (PowerSGD's error feedback and P/Q
memories, Top-K's and QSGD's residuals), and DDP changes its bucket layout after the first backward and on resume.
:class:`BucketStateMover` keeps the state with its parameters through every rebuild and resume. See
docs/techniques/ddp-compression.md (Compressor state is training state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BucketStateMover"]


class BucketStateMover:
    """Moves the per-bucket tensors of a compressor's state object between bucket layouts.

    DDP builds its buckets in reverse parameter order and rebuilds them in gradient-ready order after the first
    backward of every new DDP model, so a resumed run starts in another layout than the one its checkpoint was saved
    under. The mover splits every bucket's tensors into per-parameter pieces when the layout changes (and for a
    checkpoint), and reassembles them for a bucket the first time it is seen in a new layout.

    Args:
        shapes: shape of every parameter, by its position in ``model.parameters()``.
        dict_names: the state object's per-bucket dicts, e.g. ``("error_dict", "p_memory_dict", "q_memory_dict")``.
        powersgd: ``(matrix_approximation_rank, min_compression_rate)`` for PowerSGD's P/Q layout, else None.
    """

    def __init__(
        self, shapes: Sequence[Sequence[int]], dict_names: Sequence[str], *, powersgd: tuple[int, float] | None = None
    ) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.dict_names = tuple(dict_names)
        self.powersgd = powersgd
        #: bucket index -> its parameters (positions) in the layout the state's tensors are in
        self.layouts: dict[int, list[int]] = {}
        #: dict name -> parameter position -> that parameter's piece (waiting for the bucket it lands in)
        self.pieces: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.dict_names}

    def segments(self, name: str, layout: Sequence[int]) -> list[tuple[int, int]]:
        """``(parameter, length)`` in the order the parameters' pieces sit in that dict's tensor for ``layout``.

        Each per-bucket tensor is a concatenation of per-parameter segments in the bucket's order:

        * error feedback: the bucket's flat gradient, one segment of ``numel`` entries per parameter;
        * PowerSGD's P / Q memories (torch's ``powerSGD_hook``): one segment of ``n·r`` / ``m·r`` entries per
          compressed matrix (``n`` rows, ``m`` = the other dimensions, ``r = min(n, m, rank)``; compressed when
          ``(n + m)·r·min_compression_rate < n·m``, torch's ``_should_compress``), grouped by ``(n, m)`` in order of
          first appearance, in bucket order within a group (batched or not, each matrix's block is contiguous).
        """
        if name == "error_dict" or self.powersgd is None:
            return [(i, math.prod(self.shapes[i])) for i in layout]
        rank, min_rate = self.powersgd
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i in layout:
            shape = self.shapes[i]
            n = shape[0] if shape else 1
            m = math.prod(shape[1:]) if len(shape) > 1 else 1
            r = min(n, m, rank)
            if (n + m) * r * min_rate < n * m:
                groups.setdefault((n, m), []).append((i, (n if name == "p_memory_dict" else m) * r))
        return [seg for group in groups.values() for seg in group]

    def split_all(self, state: Any) -> None:
        """Move every bucket's tensors into per-parameter pieces (the layout is about to change, or a save)."""
        for index, layout in self.layouts.items():
            for name in self.dict_names:
                tensor = getattr(state, name).pop(index, None)
                if tensor is None:
                    continue
                segments = self.segments(name, layout)
                if sum(length for _, length in segments) != tensor.numel():
                    continue  # not the layout this mover predicts (should not happen): dropped, restarts at zero
                for (param, _length), piece in zip(segments, tensor.split([s for _, s in segments])):
                    self.pieces[name][param] = piece
        self.layouts = {}

    def enter(self, state: Any, index: int, layout: list[int], device: torch.device) -> None:
        """Called for each bucket before the compressor runs: re-layout the state if this bucket is new."""
        known = self.layouts.get(index)
        if known == layout:
            return
        if known is not None:  # DDP rebuilt its buckets: every bucket's state goes to per-parameter pieces
            self.split_all(state)
        for name in self.dict_names:
            segments = self.segments(name, layout)
            store, tensors = self.pieces[name], getattr(state, name)
            if index in tensors:
                # written after the split by a callback still in flight (NCCL): newer than the pieces
                for param, _ in segments:
                    store.pop(param, None)
            elif segments and all(param in store for param, _ in segments):
                tensors[index] = torch.cat([store.pop(param) for param, _ in segments]).to(device)
        self.layouts[index] = layout

    def state_pieces(self, state: Any) -> dict[str, dict[int, torch.Tensor]]:
        """Every per-parameter piece of the current state (CPU copies), without changing the state."""
        out: dict[str, dict[int, torch.Tensor]] = {
            name: {p: t.detach().cpu().clone() for p, t in store.items()} for name, store in self.pieces.items()
        }
        for index, layout in self.layouts.items():
            for name in self.dict_names:
                tensor = getattr(state, name).get(index)
                if tensor is None:
                    continue
                segments = self.segments(name, layout)
                if sum(length for _, length in segments) != tensor.numel():
                    continue
                for (param, _length), piece in zip(segments, tensor.detach().split([s for _, s in segments])):
                    out[name][param] = piece.cpu().clone()
        return out
