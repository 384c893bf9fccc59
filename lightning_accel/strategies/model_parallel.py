"""FSDP2 and tensor parallelism without a hand-written ``configure_model``: ``fsdp2``, ``tp`` and ``fsdp2_tp``.

:class:`AutoParallelStrategy` derives a plan from the model (:mod:`.parallel_plan`) when the LightningModule's
``configure_model`` does not parallelise it. See docs/techniques/fsdp2-tp.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel._checks import is_int
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork
from lightning_accel.strategies.parallel_plan import ParallelPlan, apply_plan, derive_plan

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AutoParallelStrategy", "batch_replicas", "fsdp2", "fsdp2_tp", "tp"]

Mode = Literal["fsdp2", "tp", "fsdp2_tp"]
_MODES = ("fsdp2", "tp", "fsdp2_tp")


def _check_size(mode: str, name: str, value: Any) -> None:
    if value == "auto":
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{mode}: {name}={value!r} must be 'auto' or an integer >= 1")


class AutoParallelStrategy(FinishesOutstandingWork, ModelParallelStrategy):
    """FSDP2 and tensor parallelism over Lightning's ``ModelParallelStrategy`` on a 2-D device mesh
    ``(data_parallel, tensor_parallel)``, with the plan derived from the model
    (:func:`~lightning_accel.strategies.parallel_plan.derive_plan`) unless ``configure_model`` parallelises it.

    The plan is printed (module → style) once on rank 0 and kept in :attr:`plan`. See docs/techniques/fsdp2-tp.md.

    Args:
        mode: ``"fsdp2"``, ``"tp"`` or ``"fsdp2_tp"``.
        data_parallel_size: devices per data-parallel group (``"auto"``: by mode, see the page).
        tensor_parallel_size: devices per tensor-parallel group (``"auto"``: by mode, see the page).
        reshard_after_forward: FSDP2 frees the gathered parameters after forward and gathers them again in backward
            (``True``: less memory, ZeRO-3-like traffic; ``False``: keeps them, ZeRO-2-like).
        print_plan: print the plan on rank 0 at setup.
        save_distributed_checkpoint: see Lightning's ``ModelParallelStrategy``.
        **kwargs: passed to ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``).
    """

    def __init__(
        self,
        *,
        mode: Mode,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        reshard_after_forward: bool = True,
        print_plan: bool = True,
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"AutoParallelStrategy(mode={mode!r}): use one of {', '.join(_MODES)}")
        _check_size(mode, "data_parallel_size", data_parallel_size)
        _check_size(mode, "tensor_parallel_size", tensor_parallel_size)
        if mode == "fsdp2" and tensor_parallel_size not in ("auto", 1):
            raise ValueError(
                f"fsdp2: tensor_parallel_size={tensor_parallel_size} — fsdp2 has no tensor "
                "parallelism; use strategy 'fsdp2_tp' for both"
            )
        if mode == "tp" and data_parallel_size not in ("auto", 1):
            raise ValueError(
                f"tp: data_parallel_size={data_parallel_size} — tp has no data parallelism (nothing "
                "would reduce the replicas' gradients); use strategy 'fsdp2_tp' for both"
            )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.mode: Mode = mode
        self.reshard_after_forward = reshard_after_forward
        self.print_plan = print_plan
        #: the plan applied at setup (``None`` before setup, or when ``configure_model`` is the user's own)
        self.plan: ParallelPlan | None = None

    # ----------------------------------------------------------------------------------------- sizes
    def resolve_sizes(self, world_size: int, devices_per_node: int) -> tuple[int, int]:
        """``(data_parallel_size, tensor_parallel_size)`` for this mode on ``world_size`` devices."""
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        mode = self.mode
        if mode == "fsdp2":
            tp = 1
            dp = world_size if dp == "auto" else dp
        elif mode == "tp":
            dp = 1
            tp = world_size if tp == "auto" else tp
            if tp != world_size:
                raise ValueError(
                    f"tp: tensor_parallel_size={tp} on {world_size} devices would leave "
                    f"{world_size // max(tp, 1)} data-parallel replicas whose gradients nothing reduces; "
                    f"use tensor_parallel_size={world_size} or strategy 'fsdp2_tp'"
                )
        else:
            if tp == "auto" and dp == "auto":
                tp = devices_per_node
            if tp == "auto":
                tp = world_size // dp if world_size % dp == 0 else 0
            if dp == "auto":
                dp = world_size // tp if tp and world_size % tp == 0 else 0
        if not (dp and tp) or dp * tp != world_size:
            raise ValueError(
                f"{mode}: tensor_parallel_size={self._tensor_parallel_size} × data_parallel_size="
                f"{self._data_parallel_size} does not fit {world_size} devices; give a tensor-parallel "
                f"size that divides the world size ({world_size}), e.g. the devices per node "
                f"({devices_per_node})"
            )
        return int(dp), int(tp)

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        self._data_parallel_size, self._tensor_parallel_size = self.resolve_sizes(world, self.num_processes)
        if world == 1:
            rank_zero_warn(
                f"strategy {self.mode!r} on a single device shards nothing; use strategy='auto' on one "
                "device, or devices >= 2"
            )
        super().setup_environment()

    # ----------------------------------------------------------------------------------------- plan
    def _apply_auto_plan(self) -> None:
        module = self.lightning_module
        assert module is not None
        dp, tp = self.device_mesh["data_parallel"].size(), self.device_mesh["tensor_parallel"].size()
        fsdp = self.mode != "tp" and dp > 1
        plan = derive_plan(module, tp_size=tp, fsdp=fsdp)
        apply_plan(
            module,
            plan,
            tp_mesh=self.device_mesh["tensor_parallel"],
            dp_mesh=self.device_mesh["data_parallel"],
            reshard_after_forward=self.reshard_after_forward,
        )
        self.plan = plan
        if self.print_plan:
            rank_zero_info(
                f"{self.mode} plan for {type(module).__name__} (data parallel {dp} × tensor parallel "
                f"{tp}):\n{plan.describe()}"
            )

    def _parallelized(self) -> bool:
        from torch.distributed.tensor import DTensor

        assert self.model is not None
        return any(isinstance(p, DTensor) for p in self.model.parameters())

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if is_overridden("configure_model", self.lightning_module) and self._parallelized():
            super().setup(trainer)  # the user's configure_model applied a plan of its own: it wins
            return
        # no configure_model, or one that only builds the model (litgpt-style lazy init): plan what it built
        # Lightning 2.6 ModelParallelStrategy.setup, without its "configure_model is required" check, after our plan
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_accel._compat import materialize_distributed_module, optimizers_to_device

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._apply_auto_plan()
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)


def fsdp2(**kwargs: Any) -> AutoParallelStrategy:
    """``Trainer(strategy="fsdp2")``: FSDP2 over all devices with an automatic plan."""
    return AutoParallelStrategy(mode="fsdp2", **kwargs)


def tp(**kwargs: Any) -> AutoParallelStrategy:
    """``Trainer(strategy="tp")``: tensor parallelism over all devices with an automatic plan."""
    return AutoParallelStrategy(mode="tp", **kwargs)


def fsdp2_tp(**kwargs: Any) -> AutoParallelStrategy:
    """``Trainer(strategy="fsdp2_tp")``: tensor parallelism inside the node × FSDP2 across nodes."""
    return AutoParallelStrategy(mode="fsdp2_tp", **kwargs)


def batch_replicas(strategy: Any) -> int:
    """How many ranks see each batch: world size ÷ the sampler's replicas (the TP size under ``tp``/``fsdp2_tp``,
    1 under DDP, FSDP2 and DeepSpeed). Summed samples and tokens are divided by it to count each batch once."""
    try:
        replicas = int(strategy.distributed_sampler_kwargs["num_replicas"])
        world = int(strategy.world_size)
    except (AttributeError, KeyError, TypeError, RuntimeError):  # single device: no sampler kwargs
        return 1
    return world // replicas if replicas > 0 and world % replicas == 0 else 1
