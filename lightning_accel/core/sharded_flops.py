"""FLOPs per device under tensor parallelism: count DTensor operations on their local shards (torch only).

torch's ``FlopCounterMode`` sees a DTensor operation before DTensor splits it into local work, so it counts the
*global* shapes: under tensor parallelism every rank would report the whole model's matmul FLOPs, while the
operations on plain tensors in between (attention on the local heads) count per rank. :class:`ShardedFlopCounterMode`
counts a DTensor operation with the shapes of the local shards instead, which is the work this device does: a
column- or row-wise sharded matmul counts ``1/T`` of its global FLOPs, a replicated one all of them. Without DTensors
it counts exactly as ``FlopCounterMode``.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from lightning_accel._compat import dtensor_local, tree_map

__all__ = ["ShardedFlopCounterMode"]


def _local(x: Any) -> Any:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    if dtensor is not None and isinstance(x, dtensor.DTensor):
        return dtensor_local(x)  # the shard this rank computes on
    return x


class ShardedFlopCounterMode(FlopCounterMode):
    """``FlopCounterMode`` that counts DTensor operations on the local shards (FLOPs per device)."""

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        # FlopCounterMode._count_flops(func_packet, out, args, kwargs) is private API, checked on torch 2.13
        super()._count_flops(  # type: ignore[no-untyped-call]  # torch leaves this private method untyped
            func_packet, tree_map(_local, out), tree_map(_local, args), tree_map(_local, kwargs)
        )
        return out
