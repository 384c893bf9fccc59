"""What :func:`~lightning_accel.attention.use_fused_attention` changed, in a module of its own: the switch
(``fused``) returns it and the block rewrite (``rewrite``) fills it in, and neither imports the other for it."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FusedAttentionChanges"]


@dataclasses.dataclass
class FusedAttentionChanges:
    """What :func:`use_fused_attention` changed.

    Attributes:
        mha: names of ``nn.MultiheadAttention`` modules that now run with ``need_weights=False``.
        kept: names of ``nn.MultiheadAttention`` modules left alone because their weights are used.
        blocks: names of hand-written blocks whose attention pattern is now rewritten.
        fused_calls: per block, how many times the pattern was replaced by one SDPA call so far (0 means the
            block's code did not match the pattern: it still runs, unchanged).
        not_fired: per block whose first forward fused nothing, the first op that broke the pattern (also warned).
        library: Hugging Face models (by module name) switched to the library's own SDPA attention, with the
            implementation they ran before (``"eager"``).
        unswitchable: Hugging Face models whose attention could not be switched, with the reason (also warned);
            their attention modules are rewritten instead.
    """

    mha: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    blocks: list[str] = dataclasses.field(default_factory=list)
    fused_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    not_fired: dict[str, str] = dataclasses.field(default_factory=dict)
    library: dict[str, str] = dataclasses.field(default_factory=dict)
    unswitchable: dict[str, str] = dataclasses.field(default_factory=dict)
    _handles: list[Any] = dataclasses.field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Undo every change (remove the hooks, switch Hugging Face models back)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
