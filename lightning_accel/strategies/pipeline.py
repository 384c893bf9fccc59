"""Pipeline parallelism for the Lightning Trainer: ``strategy="pp"`` and ``"pp_ddp"``, no change to the module.

:class:`PipelineStrategy` wires the parts and keeps Lightning's hooks: the split (:mod:`.pipeline_split`), the schedule
(:mod:`.pipeline_schedule`), stage timing (:mod:`.pipeline_timing`), the gradient reduction (:mod:`.pipeline_reduce`),
the checkpoint state (:mod:`.pipeline_state`) and the checks (:mod:`.pipeline_checks`). See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_accel.core.pipeline_plan import StagePlan, mesh_sizes, stage_counts
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork
from lightning_accel.strategies.pipeline_checks import (
    FirstBatchCheck,
    check_arguments,
    check_divides,
    check_optimizers,
    check_trainer,
)
from lightning_accel.strategies.pipeline_mesh import broadcast_weights, make_groups
from lightning_accel.strategies.pipeline_network import (  # noqa: F401 - the network's names, importable from here
    PipelineLayout,
    _Layout,
    _Offstage,
    _Stage,
    _UserLayout,
    default_pipeline_batch,
    find_layout,
    measure_stage_costs,
    token_cross_entropy,
)
from lightning_accel.strategies.pipeline_reduce import GradientReducer
from lightning_accel.strategies.pipeline_schedule import ScheduleRunner, on_cleared_grads
from lightning_accel.strategies.pipeline_split import (
    StageSplit,
    check_unsplit,
    cost_probe,
    find_network,
    sample_batch,
    split_network,
    timed_costs,
)
from lightning_accel.strategies.pipeline_state import compression_of, gather_checkpoint, load_stage_optimizers
from lightning_accel.strategies.pipeline_timing import PipelineStats, StageTimer

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PipelineLayout", "PipelineStats", "PipelineStrategy", "measure_stage_costs", "pp", "pp_ddp"]


class PipelineStrategy(FinishesOutstandingWork, DDPStrategy):
    """Pipeline parallelism: the network's repeated blocks divided over the pipeline ranks, and every training step
    one ``torch.distributed.pipelining`` schedule over the batch cut into micro-batches.

    ``"pp"`` gives every rank its stage(s); ``"pp_ddp"`` replicates the pipeline data-parallel on a
    ``(pipeline, data_parallel)`` mesh. Before the first step the split and the loss are checked against the
    module's own forward and ``training_step``; a module they do not fit describes itself with ``pipeline_layout()``,
    ``pipeline_batch()`` and ``pipeline_loss()``. :attr:`stats` keeps each step's timing (the bubble),
    :attr:`loss_check` the first batch's losses, :attr:`comm_stats` the replica average's bytes.
    See docs/techniques/pipeline.md.

    Args:
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved_1f1b"``.
        microbatches: micro-batches per step (default: the pipeline ranks for 1F1B/GPipe, 2·P for interleaved).
        stages: total stages (default: the pipeline ranks; ``V·P`` for interleaved, default ``2·P``).
        data_parallel_size: replicas of each stage (``pp``: 1; ``pp_ddp``: ``"auto"`` = world ÷ pipeline ranks).
        pipeline_size: ranks per pipeline (``"auto"``: world ÷ data_parallel_size).
        blocks_per_stage: an explicit split instead of the balancing (block counts per stage).
        network: the attribute of the LightningModule that holds the network (default: its one child with parameters).
        check_loss: compare the pipeline's loss with ``training_step`` on the first batch.
        print_plan: print the stage plan on rank 0 at setup.
        compression: compress the data-parallel gradient average (``pp_ddp``): ``"fp16"``, ``"bf16"``, ``"topk"``,
            ``"qsgd"`` or None (plain all-reduce).
        density: Top-K's fraction of entries sent (``compression="topk"``).
        levels: QSGD's quantisation levels (``compression="qsgd"``).
        balance: ``"parameters"`` (default) or ``"time"`` (measured forward + backward time per block).
        balance_shape: ``(batch, sequence length)`` of synthetic token ids for ``balance="time"`` to measure on instead
            of one micro-batch of the module's own first batch (None, the default); refused for a network whose first
            piece does not take token ids.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``timeout``, ``process_group_backend``).
    """

    def __init__(
        self,
        *,
        schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b",
        microbatches: int | None = None,
        stages: int | None = None,
        data_parallel_size: Literal["auto"] | int = 1,
        pipeline_size: Literal["auto"] | int = "auto",
        blocks_per_stage: list[int] | None = None,
        network: str | None = None,
        check_loss: bool = True,
        print_plan: bool = True,
        compression: Literal["fp16", "bf16", "topk", "qsgd"] | None = None,
        density: float = 0.01,
        levels: int = 7,
        balance: Literal["parameters", "time"] = "parameters",
        balance_shape: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        check_arguments(
            schedule=schedule,
            microbatches=microbatches,
            stages=stages,
            data_parallel_size=data_parallel_size,
            pipeline_size=pipeline_size,
            compression=compression,
            density=density,
            levels=levels,
            balance=balance,
            balance_shape=balance_shape,
        )
        if "timeout" in kwargs and isinstance(kwargs["timeout"], (int, float)):
            kwargs["timeout"] = timedelta(seconds=kwargs["timeout"])
        super().__init__(**kwargs)
        self.schedule_name = schedule
        self._microbatches_arg, self._stages_arg = microbatches, stages
        self._dp_arg, self._pp_arg = data_parallel_size, pipeline_size
        self.blocks_per_stage = blocks_per_stage
        self.network_attr = network
        self.check_loss = check_loss
        self.print_plan = print_plan
        self.compression = compression
        self.balance = balance
        self.balance_shape = tuple(balance_shape) if balance_shape is not None else None
        self.pp_size = self.dp_size = 1
        self.pp_rank = self.dp_rank = 0
        self.microbatches = 1
        self._pp_group: Any = None
        self._pp_ranks: list[int] = [0]
        self._split_module: nn.Module | None = None
        self._stage_split: StageSplit | None = None
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # the schedule's, until backward hands them back
        self._timer = StageTimer()
        self._runner = ScheduleRunner(schedule, self._timeout)
        self._loss_check = FirstBatchCheck()
        self._reducer = GradientReducer(compression, density=density, levels=levels)

    @property
    def plan(self) -> StagePlan | None:
        """The stage split (after setup)."""
        return self._stage_split.plan if self._stage_split is not None else None

    @property
    def stats(self) -> PipelineStats:
        """This rank's per-step timing: wall time and the time its stages computed."""
        return self._timer.stats

    @property
    def loss_check(self) -> dict[str, Any] | None:
        """The first-batch loss check's numbers: pipeline, reference, the dtype compared in and its tolerance."""
        return self._loss_check.numbers

    @property
    def comm_stats(self) -> Any:
        """The data-parallel gradient exchange's counters (:class:`~.ddp_compression.CommStats`; pp_ddp only)."""
        return self._reducer.comm_stats

    @property
    def _dp_hook(self) -> tuple[Any, Callable[..., Any]] | None:
        # (state, hook) of the compressed replica average, where ``ddp_<compression>`` keeps its compressor state
        return self._reducer._dp_hook

    # ----------------------------------------------------------------------------------------- sizes and groups
    def resolve_sizes(self, world: int) -> tuple[int, int]:
        """``(pipeline ranks, data-parallel replicas)`` on ``world`` processes."""
        return mesh_sizes(world, data_parallel=self._dp_arg, pipeline=self._pp_arg, compression=self.compression)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline reads the same batch (stage 0 its inputs, the last its targets)
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def _make_groups(self) -> None:
        self.pp_size, self.dp_size = self.resolve_sizes(self.world_size)
        self.pp_rank, self.dp_rank = divmod(self.global_rank, self.dp_size)
        groups = make_groups(self.pp_size, self.dp_size, self.pp_rank, self.dp_rank, timeout=self._timeout)
        self._pp_group, self._pp_ranks = groups.pipeline, groups.pipeline_ranks
        self._reducer.configure(
            dp_group=groups.data_parallel,
            dp_size=self.dp_size,
            tie_group=groups.tied,
            world_size=self.world_size,
            rank=self.global_rank,
        )

    # ----------------------------------------------------------------------------------------- the split
    def _split(self, module: pl.LightningModule, sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Find the structure, check it on ``sample`` (the module's own first batch: ``(inputs, targets)``), plan
        the stages and keep this rank's."""
        attr, layout = find_network(module, self.network_attr, sample)
        num_stages, self.microbatches = stage_counts(
            self.schedule_name, self.pp_size, stages=self._stages_arg, microbatches=self._microbatches_arg
        )
        timed = self.balance == "time" and self.blocks_per_stage is None
        split = split_network(
            attr,
            layout,
            sample[0] if sample is not None else None,
            num_stages=num_stages,
            pipeline_ranks=self.pp_size,
            pipeline_rank=self.pp_rank,
            blocks_per_stage=self.blocks_per_stage,
            measure=(lambda layout: self._timed_costs(layout, sample)) if timed else None,
        )
        self._stage_split = split
        self._timer.reset(
            pipeline_ranks=self.pp_size, microbatches=self.microbatches, stages_per_rank=len(split.modules)
        )
        if self.print_plan:
            rank_zero_info(split.describe(self.schedule_name, self.microbatches, self.pp_size, self.dp_size))

    def _timed_costs(
        self, layout: _Layout, sample: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[float, list[float], float]:
        """``balance="time"``'s stage costs, measured on this run's device with the module's own loss."""
        probe = cost_probe(
            layout, sample, microbatches=self.microbatches, loss=self._user_loss, balance_shape=self.balance_shape
        )
        return timed_costs(layout, probe, device=self.root_device, rank=self.global_rank)

    # ----------------------------------------------------------------------------------------- setup
    @override
    def setup_environment(self) -> None:
        from lightning_accel._compat import module_trainer

        trainer = module_trainer(self.lightning_module) if self.lightning_module is not None else None
        if trainer is not None:
            check_trainer(trainer, self.precision_plugin)  # before the process group: nothing has started yet
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_accel._compat import optimizers_to_device

        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        check_trainer(trainer, self.precision_plugin)
        self.accelerator.setup(trainer)
        if self._split_module is not module:  # a validate/test after fit reuses this Trainer's split
            check_unsplit(module)
            self._make_groups()
            broadcast_weights(module)
            self._split(module, sample_batch(trainer, self._pipeline_batch))
            self._split_module = module
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._build_schedule()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def configure_ddp(self) -> None:  # no DDP wrapper: the stages' gradients are reduced by hand
        pass

    def _build_schedule(self) -> None:
        split = self._stage_split
        assert split is not None
        self._runner.build(
            split.modules,
            split.plan,
            pipeline_rank=self.pp_rank,
            pipeline_ranks=self._pp_ranks,
            rank=self.global_rank,
            device=self.root_device,
            group=self._pp_group,
            microbatches=self.microbatches,
            loss=self._user_loss,
            timer=self._timer,
        )
        self._reducer.place(
            net_attr=split.net_attr, tied=split.tied, has_first=self._runner.has_first, has_last=self._runner.has_last
        )

    # ----------------------------------------------------------------------------------------- the step
    def _pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        module = self.lightning_module
        hook = getattr(module, "pipeline_batch", None)
        return hook(batch) if callable(hook) else default_pipeline_batch(batch)

    def _user_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch: the module's ``pipeline_loss``, else the token cross-entropy."""
        hook = getattr(self.lightning_module, "pipeline_loss", None)
        return hook(output, target) if callable(hook) else token_cross_entropy(output, target)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        batch = args[0] if args else kwargs.get("batch")
        inputs, targets = self._pipeline_batch(batch)
        check_divides(inputs, self.microbatches)
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        self._runner.loss_divisor = float(self.microbatches * accumulate)
        with self.precision_plugin.train_step_context():
            if not self._loss_check.done:  # not seen by batch_to_device (a loop that bypasses it)
                self._first_batch(module, args, kwargs, inputs, targets)

            def timed_step() -> torch.Tensor:
                with self._timer.step(self.root_device):
                    return self._runner.run(inputs, targets, train=True)

            # Lightning zeroes the gradients between training_step and backward (its Closure: step, zero_grad,
            # backward), or keeps them while it accumulates: the schedule runs on cleared gradients, the earlier ones
            # go back for Lightning to zero or keep, and the schedule's are added in backward()
            loss, self._grads = on_cleared_grads(list(module.parameters()), timed_step)
        return loss

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        from lightning_accel._compat import module_trainer

        batch = super().batch_to_device(batch, device, dataloader_idx)
        module = self.lightning_module
        trainer = module_trainer(module) if module is not None else None
        if not self._loss_check.done and trainer is not None and trainer.training and self._runner.built:
            # the first training batch, before any callback's on_train_batch_start: the check and the schedule's
            # set-up run outside what MFUMonitor counts and BottleneckDoctor times as the step
            inputs, targets = self._pipeline_batch(batch)
            check_divides(inputs, self.microbatches)
            with self.precision_plugin.train_step_context():
                self._first_batch(module, (batch, 0), {}, inputs, targets)
        return batch

    def _first_batch(
        self, module: pl.LightningModule, args: tuple, kwargs: dict, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        split = self._stage_split
        assert split is not None
        params = list(module.parameters())
        self._loss_check.run(
            module,
            args,
            kwargs,
            compare=self.check_loss,
            pipeline_loss=lambda: self._runner.discarded_step(params, inputs, targets),
            whole=split.whole,
            device=self.root_device,
            precision_plugin=self.precision_plugin,
        )
        split.offstage = {}  # checked: the other stages' modules are no longer needed on this rank

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The pipeline's loss on the batch (forward only), logged as ``val_loss``: the network is split, so the
        module's own ``validation_step`` (which Lightning requires to exist to run validation) is not called."""
        module = self.lightning_module
        assert module is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        inputs, targets = self._pipeline_batch(args[0] if args else kwargs.get("batch"))
        check_divides(inputs, self.microbatches)
        with self._runner.unscaled(), self.precision_plugin.val_step_context():
            loss = self._runner.run(inputs, targets, train=False)
        module.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=inputs.shape[0])
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the schedule ran the backward inside training_step; its gradients (set aside there) go back now, between
        # the hooks a backward runs (on_before_backward / on_after_backward)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._grads.items():
            p.grad = grad if p.grad is None else p.grad + grad
        self._grads = {}
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            out = closure()
            self._reducer.reduce(self.lightning_module)
            return out

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def bubble_per_rank(self, skip: int = 1) -> list[float | None]:
        """Every rank's measured bubble (a collective: call it on all ranks)."""
        return self._timer.bubble_per_rank(skip, self.world_size)

    def bubble_finding(self, skip: int = 1, threshold: float = 0.2) -> Any:
        """The ``pipeline_bubble`` finding of this run (a collective), or ``None`` below ``threshold``."""
        from lightning_accel.core.pipeline_plan import bubble_finding

        return bubble_finding(
            self.bubble_per_rank(skip),
            pipeline_ranks=self.pp_size,
            microbatches=self.microbatches,
            stages_per_rank=self.stats.stages_per_rank,
            schedule=self.schedule_name,
            threshold=threshold,
        )

    # ----------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Gather every stage's weights and optimizer states on rank 0; write one file there."""
        compression = self._reducer.state_dict()  # a collective (every rank's residuals), before the gather
        stages = self.plan.num_stages if self.plan else 1
        meta = {"pipeline_ranks": self.pp_size, "stages": stages, "schedule": self.schedule_name}
        ranks = {"pp_rank": self.pp_rank, "dp_rank": self.dp_rank, "world_size": self.world_size}
        merged = gather_checkpoint(checkpoint, meta, compression, **ranks, is_global_zero=self.is_global_zero)
        if merged is not None:
            self.checkpoint_io.save_checkpoint(merged, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.compression is not None:
            saved = compression_of(checkpoint, checkpoint_path)
            if saved is not None:
                self._reducer.restore(saved)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from lightning_accel._compat import optimizers_to_device

        load_stage_optimizers(
            checkpoint,
            self.optimizers,
            pp_rank=self.pp_rank,
            pipeline_ranks=self.pp_size,
            num_stages=self.plan.num_stages if self.plan is not None else None,
        )
        optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        self._runner.clear()
        super().teardown()


def pp(**kwargs: Any) -> PipelineStrategy:
    """``Trainer(strategy="pp")``: every rank one pipeline stage (1F1B, micro-batches = ranks)."""
    return PipelineStrategy(**kwargs)


def pp_ddp(**kwargs: Any) -> PipelineStrategy:
    """``Trainer(strategy="pp_ddp")``: pipelines of ``pipeline_size`` ranks replicated data-parallel (default 2
    replicas from 4 processes on)."""
    kwargs.setdefault("data_parallel_size", "auto")
    return PipelineStrategy(**kwargs)
