"""The checkpoint state of a pipeline-parallel run: every stage gathered on rank 0 into one ordinary Lightning file
(the unsplit model's ``state_dict``, one optimizer list per pipeline rank) and read back by stage.
See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compression_of", "gather_checkpoint", "load_stage_optimizers", "to_cpu"]


def gather_checkpoint(
    checkpoint: dict[str, Any],
    meta: dict[str, Any],
    compression: dict[str, Any] | None,
    *,
    pp_rank: int,
    dp_rank: int,
    world_size: int,
    is_global_zero: bool,
) -> dict[str, Any] | None:
    """Every stage's weights and optimizer states gathered on rank 0 (a collective): the whole model's
    ``state_dict`` (replica 0's), ``optimizer_states`` one list per pipeline rank, ``meta`` (the sizes) under
    ``"pipeline"`` and the ``compression`` state under ``ddp_<compression>``'s key; ``None`` on the other ranks."""
    import torch.distributed as dist

    mine = {
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "state_dict": to_cpu(checkpoint.get("state_dict", {})),
        "optimizer_states": to_cpu(checkpoint.get("optimizer_states", [])),
    }
    gathered: list[Any] = [None] * world_size if is_global_zero else []
    dist.gather_object(mine, gathered if is_global_zero else None, dst=0)
    if not is_global_zero:
        return None
    state: dict[str, Any] = {}
    optim: list[Any] = [None] * meta["pipeline_ranks"]
    for part in gathered:
        if part["dp_rank"] == 0:
            state.update(part["state_dict"])
            optim[part["pp_rank"]] = part["optimizer_states"]
    merged = {**checkpoint, "state_dict": state, "optimizer_states": optim, "pipeline": meta}
    if compression is not None:
        from lightning_accel.strategies.ddp_compression import _CHECKPOINT_KEY

        merged[_CHECKPOINT_KEY] = compression
    return merged


def compression_of(checkpoint: dict[str, Any], path: Any) -> dict[str, Any] | None:
    """The compressor's state a ``pp_ddp`` checkpoint holds; ``None``, with a warning, when it holds none."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_accel.strategies.ddp_compression import _CHECKPOINT_KEY

    saved = checkpoint.get(_CHECKPOINT_KEY)
    if saved is None:
        rank_zero_warn(
            f"pp_ddp: the checkpoint {path} holds no compression state (written without "
            "compression, or by a release that did not save it): the compressor restarts from zero (Top-K's "
            "error-feedback residuals and its warm-up, QSGD's random generator), so the resumed run differs "
            "from an uninterrupted one"
        )
    return saved


def load_stage_optimizers(
    checkpoint: dict[str, Any], optimizers: list[Any], *, pp_rank: int, pipeline_ranks: int, num_stages: int | None
) -> None:
    """Load this pipeline rank's optimizer states; refuse a checkpoint of other sizes, or not written by ``pp``."""
    meta = checkpoint.get("pipeline")
    if meta is None:
        raise ValueError(
            "pipeline: the checkpoint was not written by a pp Trainer (no 'pipeline' entry), so its "
            "optimizer states are not split by stage; load its state_dict into the module and fit "
            "without ckpt_path (the optimizer starts fresh)"
        )
    if meta["pipeline_ranks"] != pipeline_ranks or (num_stages is not None and meta["stages"] != num_stages):
        raise ValueError(
            f"pipeline: the checkpoint was written with {meta['pipeline_ranks']} pipeline "
            f"ranks and {meta['stages']} stages, this run has {pipeline_ranks} and "
            f"{num_stages if num_stages is not None else '?'}; resume with the same sizes (its "
            "state_dict alone loads into any run)"
        )
    for opt, state in zip(optimizers, checkpoint["optimizer_states"][pp_rank]):
        opt.load_state_dict(state)


def to_cpu(obj: Any) -> Any:
    """Tensors (in dicts, lists and tuples) moved to the host; named tuples left as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items()) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj) if not hasattr(obj, "_fields") else obj
    return obj
