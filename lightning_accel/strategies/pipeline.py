"""Pipeline parallelism for the Lightning Trainer: ``strategy="pp"`` and ``"pp_ddp"``, no change to the module.

The network's repeated blocks are divided over the pipeline ranks (:func:`~lightning_accel.core.pipeline_plan.
plan_stages`: contiguous runs balanced by parameter count, or with ``balance="time"`` by forward + backward time
measured by :func:`measure_stage_costs` on rank 0 on one micro-batch of the module's own first batch, one block at a
time on the device, every rank getting rank 0's numbers; the embedding with the first stage, the final norm, head and loss with
the last), each rank keeps only its stage(s), and every training step runs one
``torch.distributed.pipelining`` schedule over the batch cut into micro-batches:

======================  =========================================================================================
schedule                what it does
======================  =========================================================================================
``"1f1b"`` (default)    one forward, one backward (PipeDream-flush): at most ``P`` micro-batches' activations alive
``"gpipe"``             all forwards, then all backwards: ``m`` micro-batches' activations alive
``"interleaved_1f1b"``  ``stages = V·P`` virtual stages, ``V`` per rank (looped): the bubble shrinks by ``V``
======================  =========================================================================================

**What it splits** (the network is the LightningModule's one child module that holds parameters, or
``network="attr"``): Hugging Face decoder LMs (``LlamaForCausalLM``-shaped: ``model.embed_tokens`` →
``model.layers`` → ``model.norm`` → ``lm_head``, rotary position embeddings recomputed on every stage; and
``GPT2LMHeadModel``), litgpt ``GPT``, and nanoGPT-shaped models (token and position embeddings → an
``nn.ModuleList`` of blocks called ``block(x)`` → final norm → head, like :class:`lightning_accel.demo.GPT`, or a
stem on features or images in place of the embeddings), found by type and by the order the network's forward calls
its pieces on the first batch, whatever the attributes are called; any other network describes itself with ``pipeline_layout()`` (below), whatever its inputs: token ids, float features,
images. Before the first step the split is checked: the stages run in sequence in one process reproduce the
network's own forward on the first two samples of the module's own first batch (the first batch of the loader the
run reads, through ``pipeline_batch``: ``train_dataloader()`` is called once more for it, and the global random
generator is restored after, so the run's data order and draws do not change), or the strategy refuses with what to
give instead. Tied input and output embeddings (GPT-2, nanoGPT, the demo GPT) stay tied: the first and last stage
each hold the weight and their gradients are summed before every optimizer step.

**The loss.** The batch is ``(inputs, targets)`` (next-token targets already shifted), or token ids alone
(``ids``, ``(ids,)`` or ``{"input_ids": ids}``: the targets are the ids shifted by one, as Hugging Face's
``labels=ids`` does); the last stage computes the token cross-entropy. On the first batch (when the strategy moves
it to the device, before any callback's ``on_train_batch_start``, so MFUMonitor's count and the doctor's step time
exclude it) the module's own ``training_step`` runs once on the whole (unsplit) network in eval mode without
gradients, and its loss must equal the pipeline's on that batch (one schedule step in eval mode, its gradients
discarded; it also sets up the schedule's buffers), or the strategy stops with both numbers. Like is compared with
like: under mixed precision the reference runs in an autocast of the pipeline's dtype (on the host, where it runs:
the whole network may not fit the device), and the tolerance on ``|pipeline - reference| / max(1, |reference|)`` is
the dtype's: 1e-4 in fp32 (only the order of the micro-batches' sums differs), 2e-2 in bf16 and 5e-3 in fp16 (a
loss rounded to 8 or 11 significant bits, on kernels that may differ between the device and the host). Under bf16
the check therefore tells apart only losses more than 2 % apart. :attr:`PipelineStrategy.loss_check` keeps the
numbers. Modules that need something else implement any of these hooks::

    def pipeline_batch(self, batch) -> tuple[Tensor, Tensor]:   # (what goes into stage 0, the last stage's target)
    def pipeline_loss(self, logits, targets) -> Tensor:          # the loss of one micro-batch (a mean)
    def pipeline_layout(self) -> PipelineLayout:                 # a structure the strategy does not recognise

A ``pipeline_layout()`` names three submodules of the network: ``embed`` takes what ``pipeline_batch`` gives as
inputs (token ids, features, images), every block of ``blocks`` (an ``nn.ModuleList``) maps one hidden state to the
next, ``head`` gives the outputs the loss reads; together they must be the network's forward. Class logits ``(B, C)``
against integer targets ``(B,)`` need no loss hook (the token cross-entropy is then the ordinary cross-entropy);
float targets (a regression) need ``pipeline_loss``.

After the first batch ``training_step`` is not called: the step's loss (the mean over micro-batches) is what
Lightning receives, so it reaches ``on_train_batch_end(outputs=...)`` and the progress bar; log it there.

**Micro-batches and the loss scale.** Each micro-batch's loss is a mean; the schedule sums the micro-batches'
gradients and divides by ``m`` once (torch's ``scale_grads``), and with ``accumulate_grad_batches = k`` each loss is
divided by ``k`` (what Lightning does to the loss it backpropagates), so the weights equal a one-process run of the
same global batch. The batch size must be a multiple of ``microbatches``.

**pp_ddp** (``data_parallel_size > 1``): ranks form a ``(pipeline, data_parallel)`` mesh, consecutive ranks being
replicas of the same stage; each replica gets its own share of the data (``distributed_sampler_kwargs``) and the
stages' gradients are averaged over the replicas before the optimizer step. ``compression="fp16"``, ``"bf16"``,
``"topk"`` (``density=``) or ``"qsgd"`` (``levels=``) runs that average through the same communication hook the
``ddp_<compression>`` strategies register with DDP (torch's ``fp16_compress_hook`` / ``bf16_compress_hook``,
:mod:`.compression_hooks`' Top-K with error feedback and QSGD, their defaults; Top-K with ``ddp_topk``'s density
warm-up, without its optimizer-dependent momentum correction and Adam warm-up), over the replica group, with all of
a stage's gradients as one flat bucket; :attr:`PipelineStrategy.comm_stats` counts the bytes before and after
(:class:`~lightning_accel.strategies.ddp_compression.CommStats`). Top-K selects and QSGD rounds each stage's bucket on
its own, so a tied weight's two copies (first and last stage) then take the mean of their two compressed averages,
or they would drift apart. PowerSGD is not offered here (its per-matrix
state expects DDP's buckets). ``"pp_fsdp2"`` is refused with the reason (``strategies/registration.py``'s
``REFUSED``): the split and loss checks run the unsplit network in one process while ``fully_shard`` gathers
parameters only through the wrapped module's own forward, and the gradient hand-back, the tied-embedding sum and
the checkpoint gather handle plain tensors, not FSDP2's sharded DTensors.

**Faults.** Peers that stop answering (a dead rank, a deadlocked schedule) raise after ``timeout`` (default 30 min;
every pipeline group is created with it, also when the default group already existed) with this rank and its
stage(s) named, instead of hanging. An error of this rank's own stage (a shape, the user's layer) keeps its type and
message, with a note naming the rank and stage.

**Checkpoints.** ``trainer.save_checkpoint`` gathers every stage on rank 0 and writes one ordinary Lightning file
whose ``state_dict`` is the whole unsplit model's (``module.load_state_dict(torch.load(path)["state_dict"])`` loads
it into the unsplit LightningModule: that is the consolidation), and ``optimizer_states`` one list per pipeline
rank. ``fit(ckpt_path=...)`` resumes with the same number of pipeline ranks and stages. With ``compression`` the
compressor's state goes into the file as ``ddp_<compression>`` saves it, under the same key and through the same
``compression_state_dict`` / ``load_compression_state_dict``: the step counter (Top-K's warm-up does not restart),
every rank's error-feedback residual in per-parameter pieces, QSGD's generator, and each rank's
:attr:`comm_stats`; a run resumed at an epoch boundary is the uninterrupted one, bit for bit. A checkpoint without
that state (written by an earlier release) loads with a warning: the compressor restarts from zero.

Measuring: :attr:`PipelineStrategy.stats` keeps each step's wall time and the time this rank computed in its
stages; ``BottleneckDoctor`` reports the idle share (the bubble) against ``(P - 1) / (V·m + P - 1)``, and
``MFUMonitor`` counts the FLOPs each rank's stages run (per device).

Args:
    schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved_1f1b"``.
    microbatches: micro-batches per step (default: the pipeline ranks for 1F1B/GPipe, 2·P for interleaved).
    stages: total stages (default: the pipeline ranks; ``V·P`` for interleaved, default ``2·P``).
    data_parallel_size: replicas of each stage (``pp``: 1; ``pp_ddp``: ``"auto"`` = world ÷ pipeline ranks).
    pipeline_size: ranks per pipeline (``"auto"``: world ÷ data_parallel_size).
    blocks_per_stage: an explicit split instead of the balancing (block counts per stage).
    balance: ``"parameters"`` (default) or ``"time"`` (measured forward + backward time per block).
    balance_shape: ``(batch, sequence length)`` of synthetic token ids for ``balance="time"`` to measure on instead
        of one micro-batch of the module's own first batch (None, the default); refused for a network whose first
        piece does not take token ids.
    network: the attribute of the LightningModule that holds the network (default: its one child with parameters).
    check_loss: compare the pipeline's loss with ``training_step`` on the first batch (see above).
    compression: compress the data-parallel gradient average (``pp_ddp``): ``"fp16"``, ``"bf16"``, ``"topk"``,
        ``"qsgd"`` or None (plain all-reduce).
    density: Top-K's fraction of entries sent (``compression="topk"``).
    levels: QSGD's quantisation levels (``compression="qsgd"``).
    **kwargs: passed to Lightning's ``DDPStrategy`` (``timeout``, ``process_group_backend``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_accel.core.pipeline_plan import SCHEDULES, StagePlan, bubble_fraction, check_schedule, plan_stages
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork
from lightning_accel.strategies.pipeline_network import (
    PipelineLayout,
    _Layout,
    _logits,
    _Offstage,
    _Stage,
    _UserLayout,
    default_pipeline_batch,
    find_layout,
    measure_stage_costs,
    token_cross_entropy,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

_DP_COMPRESSIONS = ("fp16", "bf16", "topk", "qsgd")
#: the first-batch check's tolerance on ``|pipeline - reference| / max(1, |reference|)``, by the dtype both losses
#: are computed in: fp32 (and fp64) differ only by the order of the micro-batches' sums; a half-precision loss is
#: rounded to its 8 (bf16) or 11 (fp16) significant bits and the pipeline and its reference (on the host) may run
#: different kernels, so a few units of that rounding (bf16: 2^-8 = 0.4 %, fp16: 2^-11) are allowed
_LOSS_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

__all__ = ["PipelineLayout", "PipelineStats", "PipelineStrategy", "measure_stage_costs", "pp", "pp_ddp"]


@dataclass
class PipelineStats:
    """Per-step timing of this rank: wall time of the schedule and the time its stages computed (seconds).

    On CUDA both are timed with CUDA events (host clocks would time kernel launches, not the kernels), recorded on
    the stream and read only when asked for (:meth:`bubble`): no synchronisation per step. On CPU, ``perf_counter``.
    ``timed`` is False when none of the stage methods the compute timer wraps exists (a torch that renamed them):
    the bubble is then not reported rather than read as 100 %.
    """

    step_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    pipeline_ranks: int = 1
    microbatches: int = 1
    stages_per_rank: int = 1
    timed: bool = True
    #: CUDA steps not read yet: (start event, end event, [(chunk start, chunk end), ...])
    pending: list[tuple[Any, Any, list[tuple[Any, Any]]]] = field(default_factory=list)

    def resolve(self) -> None:
        """Read the CUDA events of the steps recorded so far into ``step_s`` / ``compute_s`` (waits for the last)."""
        for start, end, chunks in self.pending:
            end.synchronize()
            self.step_s.append(start.elapsed_time(end) / 1e3)
            self.compute_s.append(sum(s.elapsed_time(e) for s, e in chunks) / 1e3)
        self.pending.clear()

    @property
    def expected_bubble(self) -> float:
        return bubble_fraction(self.pipeline_ranks, self.microbatches, self.stages_per_rank)

    def bubble(self, skip: int = 1) -> float | None:
        """The measured idle share of the steps after ``skip`` warm-up steps: 1 - compute / wall; ``None`` when it
        was not measured (no step, or the compute timer's hooks never ran: no compute is not a 100 % bubble)."""
        self.resolve()
        step, comp = self.step_s[skip:], self.compute_s[skip:]
        if not self.timed or not step or sum(step) <= 0 or sum(comp) <= 0:
            return None
        return max(0.0, 1.0 - sum(comp) / sum(step))


def _is_peer_failure(err: BaseException) -> bool:
    """Whether a schedule error comes from the communication with another stage (a timeout, a closed connection)
    rather than from this rank's own computation."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return any(
        s in text
        for s in (
            "timed out",
            "timeout",
            "connection closed",
            "connection reset",
            "broken pipe",
            "gloo",
            "nccl",
            "peer",
        )
    )


# ------------------------------------------------------------------------------------------------------ strategy
class PipelineStrategy(FinishesOutstandingWork, DDPStrategy):
    __doc__ = __doc__

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
        if schedule not in SCHEDULES:
            raise ValueError(f"PipelineStrategy(schedule={schedule!r}): use one of {', '.join(SCHEDULES)}")
        for name, value in (("microbatches", microbatches), ("stages", stages)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"PipelineStrategy({name}={value!r}) must be an integer >= 1 (or None: automatic)")
        for name, value in (("data_parallel_size", data_parallel_size), ("pipeline_size", pipeline_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"PipelineStrategy({name}={value!r}) must be 'auto' or an integer >= 1")
        if compression is not None and compression not in _DP_COMPRESSIONS:
            raise ValueError(
                f"PipelineStrategy(compression={compression!r}): use one of "
                f"{', '.join(map(repr, _DP_COMPRESSIONS))} or None (plain all-reduce); PowerSGD is not "
                "offered in the data-parallel dimension"
            )
        if compression == "topk" and (
            isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1
        ):
            raise ValueError(f"PipelineStrategy(density={density!r}) must be a fraction in (0, 1], e.g. 0.01")
        if compression == "qsgd" and (
            isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127
        ):
            raise ValueError(f"PipelineStrategy(levels={levels!r}) must be an integer in 1..127 (7 = 4 bits per entry)")
        if balance not in ("parameters", "time"):
            raise ValueError(f"PipelineStrategy(balance={balance!r}): use 'parameters' (the default) or 'time'")
        if balance_shape is not None and (
            not isinstance(balance_shape, (tuple, list))
            or len(balance_shape) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in balance_shape)
        ):
            raise ValueError(
                f"PipelineStrategy(balance_shape={balance_shape!r}) must be (batch, sequence length), two integers >= 1 "
                "(or None, the default: one micro-batch of the module's own first batch)"
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
        #: the stage split (after setup)
        self.plan: StagePlan | None = None
        self.stats = PipelineStats()
        self.pp_size = self.dp_size = 1
        self.pp_rank = self.dp_rank = 0
        self.microbatches = 1
        self._stages: list[Any] = []
        self._stage_modules: list[_Stage] = []
        self._schedule: Any = None
        self._offstage: dict[str, nn.Module] = {}
        self._tied: list[tuple[str, str]] = []
        self._tie_group: Any = None
        self._checked = False
        self._split_module: nn.Module | None = None
        self._compute = 0.0
        self._chunk_events: list[tuple[Any, Any]] | None = None  # CUDA: this step's compute events
        self._loss_divisor = 1.0
        self._grads: dict[nn.Parameter, torch.Tensor] = {}
        self._layout: _Layout | None = None
        self.compression = compression
        self.balance = balance
        self.balance_shape = tuple(balance_shape) if balance_shape is not None else None
        self._compression_knobs = (
            {"density": float(density)}
            if compression == "topk"
            else ({"levels": levels} if compression == "qsgd" else {})
        )
        #: the data-parallel gradient exchange's counters (:class:`~.ddp_compression.CommStats`; pp_ddp only)
        self.comm_stats: Any = None
        self._dp_hook: tuple[Any, Callable[..., Any]] | None = None
        #: the ``ddp_<compression>`` strategy object whose state-dict methods save and restore the compressor's state
        self._compression_holder: Any = None
        self._saved_compression: dict[str, Any] | None = None  # from a checkpoint, until the hook is made
        #: the first-batch loss check's numbers: pipeline, reference, the dtype compared in and its tolerance
        self.loss_check: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------- sizes and groups
    def resolve_sizes(self, world: int) -> tuple[int, int]:
        """``(pipeline ranks, data-parallel replicas)`` on ``world`` processes."""
        dp, p = self._dp_arg, self._pp_arg
        if dp == "auto" and p == "auto":
            dp = 1 if world < 4 else 2
        if p == "auto":
            p = world // dp if world % dp == 0 else 0  # type: ignore[operator]
        if dp == "auto":
            dp = world // p if p and world % p == 0 else 0
        if not (p and dp) or p * dp != world:
            raise ValueError(
                f"pipeline: pipeline_size={self._pp_arg} × data_parallel_size={self._dp_arg} does not "
                f"fit {world} processes; give sizes whose product is {world}"
            )
        if self.compression is not None and dp == 1:
            raise ValueError(
                f"pipeline: compression={self.compression!r} compresses the all-reduce over data-parallel "
                f"replicas, but {world} processes with data_parallel_size={self._dp_arg} make 1 replica "
                "per stage (nothing to reduce); use strategy='pp_ddp' / data_parallel_size='auto' with "
                "more processes, or compression=None"
            )
        return int(p), int(dp)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline reads the same batch (stage 0 its inputs, the last its targets)
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def _make_groups(self) -> None:
        import torch.distributed as dist

        world, rank = self.world_size, self.global_rank
        self.pp_size, self.dp_size = self.resolve_sizes(world)
        self.pp_rank, self.dp_rank = rank // self.dp_size, rank % self.dp_size
        self._pp_group = self._dp_group = None
        self._dp_hook = None  # a compression hook's state is bound to the replica group
        self._compression_holder = None
        # every rank creates every group, in the same order (torch's new_group contract). Each group carries this
        # strategy's timeout: gloo's point-to-point waits keep the timeout their group was created with, so the
        # world group (created before this strategy, perhaps by an earlier fit) would not honour ``timeout``.
        timeout = self._timeout
        for d in range(self.dp_size):
            ranks = [r * self.dp_size + d for r in range(self.pp_size)]
            group = dist.new_group(ranks, timeout=timeout)
            if d == self.dp_rank:
                self._pp_group, self._pp_ranks = group, ranks
        for p in range(self.pp_size):
            ranks = [p * self.dp_size + d for d in range(self.dp_size)]
            group = dist.new_group(ranks, timeout=timeout) if self.dp_size > 1 else None
            if p == self.pp_rank:
                self._dp_group = group
        for d in range(self.dp_size):
            ranks = [d, (self.pp_size - 1) * self.dp_size + d]
            group = dist.new_group(ranks, timeout=timeout) if self.pp_size > 1 else None
            if d == self.dp_rank:
                self._tie_group = group

    # ----------------------------------------------------------------------------------------- the split
    def _network(self, module: nn.Module) -> tuple[str, nn.Module]:
        if self.network_attr is not None:
            net = getattr(module, self.network_attr, None)
            if not isinstance(net, nn.Module):
                raise ValueError(
                    f"pipeline: network={self.network_attr!r} is not a module attribute of {type(module).__name__}"
                )
            return self.network_attr, net
        children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(children) != 1:
            raise ValueError(
                f"pipeline: {type(module).__name__} has {len(children)} child modules with parameters "
                f"({', '.join(n for n, _ in children) or 'none'}); keep the network in one attribute "
                "or name it with PipelineStrategy(network='attr')"
            )
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"pipeline: {type(module).__name__} registers parameters directly on the "
                "LightningModule; the split cannot place them: move them into the network"
            )
        return children[0]

    def _split(self, module: pl.LightningModule, sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Find the structure, check it on ``sample`` (the module's own first batch: ``(inputs, targets)``), plan
        the stages and keep this rank's."""
        attr, net = self._network(module)
        hook = getattr(module, "pipeline_layout", None)
        first_rows = _rows(sample[0], 2) if sample is not None else None
        layout = _UserLayout(net, hook()) if callable(hook) else find_layout(net, first_rows)
        self._layout, self._net_attr = layout, attr
        blocks = layout.block_list()
        num_stages = self._stages_arg or (self.pp_size * (2 if SCHEDULES[self.schedule_name][1] else 1))
        m = self._microbatches_arg or (num_stages if SCHEDULES[self.schedule_name][1] else self.pp_size)
        check_schedule(self.schedule_name, num_stages=num_stages, pipeline_ranks=self.pp_size, microbatches=m)
        self.microbatches = m
        self._check_split(layout, sample[0] if sample is not None else None)
        # every parameter must belong to the embedding, a block or the head
        placed = {
            id(p) for path in layout.first + layout.last + [layout.blocks] for p in net.get_submodule(path).parameters()
        }
        stray = [n for n, p in net.named_parameters() if id(p) not in placed]
        if stray:
            raise ValueError(
                f"pipeline: parameters outside the embedding, the blocks and the head cannot be placed "
                f"on a stage: {', '.join(f'{attr}.{n}' for n in stray[:5])}; describe the network with "
                "pipeline_layout()"
            )
        first_ids = {
            id(p): n
            for path in layout.first
            for n, p in net.get_submodule(path).named_parameters(prefix=path, remove_duplicate=False)
        }
        self._tied = [
            (first_ids[id(p)], n)
            for path in layout.last
            for n, p in net.get_submodule(path).named_parameters(prefix=path, remove_duplicate=False)
            if id(p) in first_ids
        ]
        if self.balance == "time" and self.blocks_per_stage is None:
            first_cost, costs, last_cost = self._timed_costs(layout, sample)
            unit = "µs fwd+bwd"
        else:
            costs = [float(sum(p.numel() for p in b.parameters())) for b in blocks]
            first_cost = float(sum(p.numel() for path in layout.first for p in net.get_submodule(path).parameters()))
            last_cost = float(sum(p.numel() for path in layout.last for p in net.get_submodule(path).parameters()))
            unit = "parameters"
        plan = plan_stages(
            costs,
            num_stages,
            pipeline_ranks=self.pp_size,
            first_cost=first_cost,
            last_cost=last_cost,
            unit=unit,
            blocks_per_stage=self.blocks_per_stage,
        )
        self.plan = plan
        local = plan.stages_of(self.pp_rank)
        self._stage_modules = [_Stage(layout, plan.blocks[s], first=s == 0, last=s == num_stages - 1) for s in local]
        # what this rank does not run is replaced by a placeholder (the names of what it runs stay the original's)
        keep_blocks = {i for s in local for i in plan.blocks[s]}
        self._offstage = {}
        for i in range(len(blocks)):
            if i not in keep_blocks:
                self._offstage[f"{layout.blocks}.{i}"] = blocks[i]
                blocks[i] = _Offstage()
        for paths, keep in ((layout.first, 0 in local), (layout.last, num_stages - 1 in local)):
            if not keep:
                for path in paths:
                    self._offstage[path] = net.get_submodule(path)
                    _set_submodule(net, path, _Offstage())
        self.stats = PipelineStats(pipeline_ranks=self.pp_size, microbatches=m, stages_per_rank=len(local))
        if self.print_plan:
            rank_zero_info(
                f"pp plan for {type(net).__name__} ({layout.name}), {self.schedule_name}, {m} micro-"
                f"batches, {self.pp_size} pipeline ranks x {self.dp_size} data-parallel:\n"
                f"{plan.describe(f'{attr}.{layout.blocks}')}"
                + (f"\n  tied across first and last stage: {self._tied}" if self._tied else "")
            )

    def _timed_costs(
        self, layout: _Layout, sample: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[float, list[float], float]:
        """``balance="time"``: rank 0 measures (embedding, blocks, head + loss) on one micro-batch of its first
        batch (synthetic token ids of ``balance_shape`` when that is given, or when there is no batch) and every
        rank gets its numbers, so all ranks build the same plan."""
        import torch.distributed as dist

        probe: dict[str, Any]
        if self.balance_shape is None and sample is not None:
            inputs, targets = sample
            rows = max(1, inputs.shape[0] // self.microbatches) if inputs.dim() else 1
            probe = {"inputs": _rows(inputs, rows), "targets": _rows(targets, rows), "loss": self._user_loss}
        else:
            shape = self.balance_shape or (2, 8)
            if layout.synthetic_ids((1, 1)) is None:
                first = type(layout.net.get_submodule(layout.first[0])).__name__
                raise ValueError(
                    f"PipelineStrategy(balance='time', balance_shape={shape!r}) measures on token ids, and "
                    f"{type(layout.net).__name__}'s first piece ({first}) does not take them: leave "
                    "balance_shape=None to measure on one micro-batch of the module's own first batch"
                    + ("" if sample is not None else " (and give the Trainer a train loader to read it from)")
                )
            probe = {"shape": shape}
        mine = measure_stage_costs(layout, self.root_device, **probe) if self.global_rank == 0 else None
        if dist.is_available() and dist.is_initialized():
            box = [mine]
            dist.broadcast_object_list(box, src=0)
            mine = box[0]
        assert mine is not None
        return mine

    def _check_split(self, layout: _Layout, inputs: torch.Tensor | None = None) -> None:
        """The stages in sequence must be the network's own forward, in eval mode, on the first two rows of
        ``inputs`` (the module's own first batch: float features, images, token ids, whatever it trains on); without
        a batch, on synthetic token ids for a network whose first piece is an ``nn.Embedding``."""
        net = layout.net
        x = _rows(inputs, 2) if inputs is not None else layout.synthetic_ids((2, 8))
        if x is None:
            raise ValueError(
                f"pipeline: no batch to check the split of {type(net).__name__} on: its first piece "
                f"({type(net.get_submodule(layout.first[0])).__name__}) does not take token ids, and the Trainer "
                "gave no loader to read its first batch from; give the LightningModule a train_dataloader() (or "
                "pass the loader to trainer.fit)"
            )
        home = next((t.device for t in net.parameters() if t.device.type != "meta"), None)
        if home is not None:
            x = x.to(home)
        was = net.training
        net.eval()
        try:
            with torch.no_grad():
                want = _logits(net(x))
                h = layout.embed(x)
                ctx = layout.context(h)
                for block in layout.block_list():
                    h = layout.call_block(block, h, ctx)
                got = layout.head(h)
        except Exception as err:
            raise ValueError(
                f"pipeline: running {type(net).__name__} as {layout.name} on its first batch (inputs "
                f"{tuple(x.shape)} {x.dtype}) failed ({err!r}); describe it with pipeline_layout()"
            ) from err
        finally:
            net.train(was)
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("inf")
        if not diff <= 1e-4 * max(1.0, want.float().abs().max().item()):
            raise ValueError(
                f"pipeline: {type(net).__name__} run as {layout.name} does not reproduce its own forward "
                f"(max |difference| {diff:.3g}): its forward does more than embed → blocks → head; "
                "describe it with pipeline_layout()"
            )

    def _sample_batch(self, trainer: pl.Trainer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(inputs, targets)`` of the first batch of the loader this run reads (the train loader for ``fit``),
        as the user's loader gives it: what the split check and the stage-cost probe run on. ``None`` when the run
        has no loader to read (the checks then fall back to token ids, for a network that takes them).

        The loader's ``*_dataloader()`` hook is called once more for this (Lightning calls it again for the run),
        and one batch is read from a fresh iterator, with the global random generator saved and restored around it
        (a shuffling sampler draws its seed from it): the run's data order and random draws are unchanged."""
        from lightning.pytorch.trainer.states import TrainerFn
        from lightning.pytorch.utilities import CombinedLoader

        from lightning_accel._compat import stage_data_source

        source = stage_data_source(trainer)
        if source is None or not source.is_defined():
            return None
        with torch.random.fork_rng(devices=[]):
            loader = source.dataloader()
            if loader is None:
                return None
            combined = CombinedLoader(
                loader, "max_size_cycle" if trainer.state.fn == TrainerFn.FITTING else "sequential"
            )
            try:
                iter(combined)
                batch = next(combined)[0]
            except StopIteration:
                return None
            finally:
                combined.reset()
        return self._pipeline_batch(batch)

    def _broadcast_weights(self, module: nn.Module) -> None:
        import torch.distributed as dist

        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)

    # ----------------------------------------------------------------------------------------- setup
    @override
    def setup_environment(self) -> None:
        from lightning_accel._compat import module_trainer

        trainer = module_trainer(self.lightning_module) if self.lightning_module is not None else None
        if trainer is not None:
            self._check_trainer(trainer)  # before the process group: nothing has started when it refuses
        super().setup_environment()

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """The Trainer settings a pipeline cannot honour (checked before the process group starts)."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "pipeline: precision with a gradient scaler (16-mixed) is not supported: the scaler "
                "would have to see the loss inside the schedule; use precision='bf16-mixed' or 32"
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
            raise ValueError(
                f"pipeline: gradient_clip_val={trainer.gradient_clip_val} clips by the norm, which each "
                "stage would compute over its own parameters only; use gradient_clip_algorithm='value'"
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_accel._compat import optimizers_to_device

        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        self._check_trainer(trainer)
        self.accelerator.setup(trainer)
        if self._split_module is not module:  # a validate/test after fit reuses this Trainer's split
            if any(isinstance(m, _Offstage) for m in module.modules()):
                raise ValueError(
                    f"pipeline: this {type(module).__name__} was split by another pp Trainer (its other "
                    "stages' modules are gone on this rank); build the module again, or load the "
                    "consolidated checkpoint into a fresh one"
                )
            self._make_groups()
            self._broadcast_weights(module)
            self._split(module, self._sample_batch(trainer))
            self._split_module = module
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._build_schedule(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for opt in self.optimizers:
                if isinstance(opt, torch.optim.LBFGS):
                    raise ValueError(
                        "pipeline: LBFGS re-evaluates the loss inside its step and searches lines on "
                        "each stage's parameters separately; use a first-order optimizer"
                    )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def configure_ddp(self) -> None:  # no DDP wrapper: the stages' gradients are reduced by hand
        pass

    def _build_schedule(self, trainer: pl.Trainer) -> None:
        from torch.distributed import pipelining

        assert self.plan is not None
        local = self.plan.stages_of(self.pp_rank)
        self._stages = []
        for s, mod in zip(local, self._stage_modules):
            stage = pipelining.PipelineStage(mod, s, self.plan.num_stages, self.root_device, group=self._pp_group)
            self._time_stage(stage)
            self._stages.append(stage)
        cls = getattr(pipelining, SCHEDULES[self.schedule_name][0])
        multi = SCHEDULES[self.schedule_name][1]
        self._schedule = cls(
            self._stages if multi else self._stages[0],
            n_microbatches=self.microbatches,
            loss_fn=self._loss_fn,
            scale_grads=False,
        )

    def _time_stage(self, stage: Any) -> None:
        """Add the stage's forward and backward compute times to the step's (torch 2.13: ``forward_one_chunk`` /
        ``backward_one_chunk`` are the stage's per-micro-batch entry points)."""
        wrapped = 0
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, name, None)
            if inner is None:
                continue
            wrapped += 1

            def timed(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
                if self._chunk_events is not None:  # CUDA: events on the stream, read after the step
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    try:
                        return _inner(*args, **kwargs)
                    finally:
                        end.record()
                        self._chunk_events.append((begin, end))
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self._compute += time.perf_counter() - start

            setattr(stage, name, timed)
        if wrapped == 0:
            self.stats.timed = False
            rank_zero_info(
                "pp: this torch's PipelineStage has none of forward_one_chunk / backward_one_chunk: "
                "the pipeline bubble is not measured"
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

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._user_loss(output, target) / self._loss_divisor

    @property
    def _has_first(self) -> bool:
        return any(s.is_first for s in self._stages)

    @property
    def _has_last(self) -> bool:
        return any(s.is_last for s in self._stages)

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> torch.Tensor:
        import torch.distributed as dist

        losses: list[torch.Tensor] = []
        args = (inputs,) if self._has_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self._has_last else {}
        try:
            if train:
                self._schedule.step(*args, **kwargs)
            else:
                self._schedule.eval(*args, **kwargs)
        except Exception as err:
            stages = [s.stage_index for s in self._stages]
            where = (
                f"pipeline rank {self.global_rank} (stage {', '.join(map(str, stages))} of "
                f"{self.plan.num_stages if self.plan else '?'})"
            )
            if _is_peer_failure(err):
                raise RuntimeError(
                    f"{where}: the {self.schedule_name} schedule failed, a peer stage died or stopped "
                    f"answering (timeout {self._timeout}): {err}"
                ) from err
            # this rank's own error (the user's layer, a shape, memory): the original exception, its type and
            # message first, with where it was raised added
            note = f"raised on {where} inside the {self.schedule_name} schedule"
            if hasattr(err, "add_note"):
                err.add_note(note)
                raise
            raise RuntimeError(f"{err} ({note})") from err
        last_rank = self._pp_ranks[self.plan.ranks[-1]] if self.plan else 0
        if self._has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean() * self._loss_divisor
        else:
            loss = torch.zeros((), device=self.root_device)
        if self.pp_size > 1:
            dist.broadcast(loss, src=last_rank, group=self._pp_group)
        return loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        batch = args[0] if args else kwargs.get("batch")
        inputs, targets = self._pipeline_batch(batch)
        self._check_divides(inputs)
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        self._loss_divisor = float(self.microbatches * accumulate)
        with self.precision_plugin.train_step_context():
            if not self._checked:  # not seen by batch_to_device (a loop that bypasses it)
                self._first_batch(module, args, kwargs, inputs, targets)
            # Lightning zeroes the gradients between training_step and backward (its Closure: step, zero_grad,
            # backward), or keeps them while it accumulates: the schedule runs on cleared gradients, the earlier ones
            # go back for Lightning to zero or keep, and the schedule's are added in backward()
            params = list(module.parameters())
            earlier = [p.grad for p in params]
            for p in params:
                p.grad = None
            self._compute = 0.0
            if self.root_device.type == "cuda":
                self._chunk_events = []
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                loss = self._run(inputs, targets, train=True)
                end.record()
                self.stats.pending.append((begin, end, self._chunk_events))
                self._chunk_events = None
            else:
                start = time.perf_counter()
                loss = self._run(inputs, targets, train=True)
                self.stats.step_s.append(time.perf_counter() - start)
                self.stats.compute_s.append(self._compute)
            self._grads = {p: p.grad for p in params if p.grad is not None}
            for p, grad in zip(params, earlier):
                p.grad = grad
        return loss

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        from lightning_accel._compat import module_trainer

        batch = super().batch_to_device(batch, device, dataloader_idx)
        module = self.lightning_module
        trainer = module_trainer(module) if module is not None else None
        if not self._checked and trainer is not None and trainer.training and self._schedule is not None:
            # the first training batch, before any callback's on_train_batch_start: the check and the schedule's
            # set-up run outside what MFUMonitor counts and BottleneckDoctor times as the step
            inputs, targets = self._pipeline_batch(batch)
            self._check_divides(inputs)
            with self.precision_plugin.train_step_context():
                self._first_batch(module, (batch, 0), {}, inputs, targets)
        return batch

    def _check_divides(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"pipeline: a batch of {inputs.shape[0]} does not divide into microbatches="
                f"{self.microbatches}; use a batch size that is a multiple of {self.microbatches} "
                "(drop_last=True for a short last batch), or other microbatches"
            )

    def _first_batch(
        self, module: pl.LightningModule, args: tuple, kwargs: dict, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        self._check_first_batch(module, args, kwargs, inputs, targets)
        self._checked = True
        self._offstage = {}  # checked: the other stages' modules are no longer needed on this rank

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The pipeline's loss on the batch (forward only), logged as ``val_loss``: the network is split, so the
        module's own ``validation_step`` (which Lightning requires to exist to run validation) is not called."""
        module = self.lightning_module
        assert module is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        inputs, targets = self._pipeline_batch(args[0] if args else kwargs.get("batch"))
        self._check_divides(inputs)
        divisor, self._loss_divisor = self._loss_divisor, 1.0
        try:
            with self.precision_plugin.val_step_context():
                loss = self._run(inputs, targets, train=False)
        finally:
            self._loss_divisor = divisor
        module.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=inputs.shape[0])
        return loss

    def _check_first_batch(
        self, module: pl.LightningModule, args: tuple, kwargs: dict, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """The module's own ``training_step`` on the whole network vs the pipeline's loss, both in eval mode (with
        ``check_loss=False`` only the pipeline's step, which sets up the schedule)."""
        from lightning_accel._compat import suspended_dispatch_modes

        was = module.training
        module.eval()
        try:
            # not model FLOPs of the step: a FLOP counter around it (MFUMonitor's first batch) does not see the check
            with suspended_dispatch_modes():
                self._check_losses(module, args, kwargs, inputs, targets)
        finally:
            module.train(was)

    def _check_losses(
        self, module: pl.LightningModule, args: tuple, kwargs: dict, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        # a whole schedule step (its backward sets up the schedule's buffers, which must not happen under a FLOP
        # counter's module tracking: torch 2.13 refuses that autograd.grad), its gradients discarded
        params = list(module.parameters())
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        divisor, self._loss_divisor = self._loss_divisor, 1.0
        try:
            piped = float(self._run(inputs, targets, train=True))
        finally:
            self._loss_divisor = divisor
            for p, grad in zip(params, earlier):
                p.grad = grad
        if not self.check_loss:
            return
        device = self.root_device
        swapped = self._restore_offstage()
        try:
            if device.type != "cpu":  # the whole network does not fit the device: it runs once on the host
                module.to("cpu")
            cpu_args = _to_cpu((args, kwargs)) if device.type != "cpu" else (args, kwargs)
            # the check is not a step: what training_step logs is not logged (Lightning also refuses logging here)
            module.log, module.log_dict = _no_log, _no_log  # type: ignore[method-assign]
            # like with like: the reference computes in the pipeline's precision (its autocast, on the host)
            autocast, dtype = self._reference_precision(module)
            with torch.no_grad(), autocast:
                out = module.training_step(*cpu_args[0], **cpu_args[1])
        finally:
            del module.log, module.log_dict
            self._remove_offstage(swapped)
            if device.type != "cpu":
                module.to(device)
        own = out["loss"] if isinstance(out, dict) else out
        if not isinstance(own, torch.Tensor):
            raise ValueError(
                "pipeline: training_step returned no loss tensor on the first batch; the pipeline's "
                "loss cannot be checked against it (PipelineStrategy(check_loss=False) skips the check)"
            )
        self._compare_losses(module, piped, float(own), dtype)

    def _compare_losses(self, module: nn.Module, piped: float, own: float, dtype: torch.dtype) -> None:
        """Refuse the run unless the pipeline's first-batch loss ``piped`` is the module's own ``own``, both
        computed in ``dtype``, within that dtype's tolerance (:data:`_LOSS_RTOL`); the numbers go to
        :attr:`loss_check`."""
        rtol = _LOSS_RTOL.get(dtype, _LOSS_RTOL[torch.float32])
        self.loss_check = {"pipeline": piped, "reference": own, "dtype": str(dtype), "rtol": rtol}
        if not abs(own - piped) <= rtol * max(1.0, abs(own)):
            hooks = (
                "your pipeline_loss / pipeline_batch"
                if hasattr(module, "pipeline_loss")
                else (
                    "the token cross-entropy of the network's logits against the targets (batch (inputs, targets), or "
                    "ids shifted by one)"
                )
            )
            raise ValueError(
                f"pipeline: on the first batch the pipeline's loss ({piped:.6g}: {hooks}) differs from "
                f"{type(module).__name__}.training_step's ({own:.6g}) by more than {rtol:g} (relative, both "
                f"computed in {str(dtype).replace('torch.', '')}); define "
                "`pipeline_loss(self, logits, targets)` and/or `pipeline_batch(self, batch)` on the "
                "LightningModule so that they compute your loss"
            )

    def _reference_precision(self, module: nn.Module) -> tuple[Any, torch.dtype]:
        """The autocast the first-batch reference runs in (always on the host) and the dtype the comparison is in:
        under mixed precision (``bf16-mixed``, ``16-mixed``) an autocast of the pipeline's own dtype, so both losses
        come from the same arithmetic; otherwise the parameters' dtype (``32-true``, ``bf16-true``) and no autocast
        beyond what is already active."""
        from contextlib import nullcontext

        from lightning.pytorch.plugins.precision import MixedPrecision

        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision):
            dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
            return torch.autocast("cpu", dtype=dtype), dtype
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        return nullcontext(), dtype

    def _restore_offstage(self) -> dict[str, nn.Module]:
        assert self._layout is not None
        net = self._layout.net
        swapped = {}
        for path, original in self._offstage.items():
            swapped[path] = net.get_submodule(path)
            _set_submodule(net, path, original)
        return swapped

    def _remove_offstage(self, swapped: dict[str, nn.Module]) -> None:
        assert self._layout is not None
        for path, placeholder in swapped.items():
            _set_submodule(self._layout.net, path, placeholder)

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
            self._reduce_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def _reduce_gradients(self) -> None:
        """Sum the tied embedding's gradients of the first and last stage; average over data-parallel replicas."""
        import torch.distributed as dist

        module = self.lightning_module
        self._reduce_tied(average=False)
        if self._dp_group is not None and self.compression is not None:
            self._reduce_compressed([p for p in module.parameters() if p.grad is not None])
            if self.compression in ("topk", "qsgd"):
                # Top-K selects and QSGD rounds over each stage's own flat bucket, so the first and the last stage
                # would apply different updates to their copies of a tied weight, which would drift apart: both take
                # the mean of the two compressed averages (each an estimate of the same gradient)
                self._reduce_tied(average=True)
        elif self._dp_group is not None:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self._dp_group)
                    p.grad.div_(self.dp_size)

    def _reduce_tied(self, *, average: bool) -> None:
        """All-reduce the tied weights' gradients between the first and the last stage (sum, or mean)."""
        import torch.distributed as dist

        if not (self._tied and self._tie_group is not None and (self._has_first or self._has_last)):
            return
        params = dict(self.lightning_module.named_parameters(remove_duplicate=False))
        prefix = self._net_attr + "."
        for first, last in self._tied:
            p = params.get(prefix + (first if self._has_first else last))
            if p is not None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad, group=self._tie_group)
                p.grad = grad.div_(2) if average else grad

    def _make_dp_hook(self) -> tuple[Any, Callable[..., Any]]:
        """(state, hook): the hook ``ddp_<compression>`` registers with DDP, over the replica group."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        from lightning_accel.strategies import compression_hooks

        if self.compression in ("fp16", "bf16"):
            self._attach_compressor_state(None)  # no compressor state: the counters only
            cast = default_hooks.fp16_compress_hook if self.compression == "fp16" else default_hooks.bf16_compress_hook
            return self._dp_group, cast
        state: Any
        if self.compression == "topk":
            from lightning_accel.strategies.ddp_compression import DEFAULT_DENSITY_WARMUP_STEPS

            # ddp_topk's density warm-up; its momentum correction and Adam warm-up are not applied here
            knobs: dict[str, Any] = {"density_warmup_steps": DEFAULT_DENSITY_WARMUP_STEPS, **self._compression_knobs}
            state, hook = (
                compression_hooks.TopKState(process_group=self._dp_group, **knobs),
                compression_hooks.topk_hook,
            )
        else:
            state = compression_hooks.QSGDState(process_group=self._dp_group, **self._compression_knobs)
            hook = compression_hooks.qsgd_hook
        self._attach_compressor_state(state)
        return state, hook

    def _holder(self) -> Any:
        """A ``DDPCompressionStrategy`` of this compression, never set up: it holds the replica average's compressor
        state so that its own ``compression_state_dict`` / ``load_compression_state_dict`` save and restore it, in
        ``ddp_topk`` / ``ddp_qsgd``'s checkpoint format (one copy of that code)."""
        if self._compression_holder is None:
            from lightning_accel.strategies.ddp_compression import DDPCompressionStrategy

            holder = DDPCompressionStrategy(compression=self.compression, **self._compression_knobs)  # type: ignore[arg-type]
            holder.cluster_environment = self.cluster_environment  # its ranks are this run's
            self._compression_holder = holder
        return self._compression_holder

    def _attach_compressor_state(self, state: Any | None) -> None:
        """Give the new compressor state to the holder, with a mover that splits the stage's one flat bucket into
        per-parameter pieces (the checkpoint's format), then restore a checkpoint's state into it."""
        module = self.lightning_module
        holder = self._holder()
        holder.compressor_state = state
        holder._make_mover(list(module.parameters()))  # same package: ddp_compression's per-parameter layout
        saved = self._saved_compression
        if saved is not None:
            holder.load_compression_state_dict(saved)
            self._saved_compression = None
            by_rank = saved.get("comm_stats_of_ranks")
            if holder.compression == saved.get("compression") and by_rank and len(by_rank) == self.world_size:
                from lightning_accel.strategies.ddp_compression import CommStats

                holder.comm_stats = CommStats(**by_rank[self.global_rank])  # this rank's own counters
        self.comm_stats = holder.comm_stats  # restored counters, or the holder's fresh ones

    def _reduce_compressed(self, params: list[nn.Parameter]) -> None:
        """Average the stage's gradients over the replicas through a DDP compression hook: all of them as one
        flat bucket (index 0 every step, so Top-K's error residual stays attached to the same entries)."""
        if self._dp_hook is None:
            self._dp_hook = self._make_dp_hook()
        state, hook = self._dp_hook
        flat = torch.cat([p.grad.detach().reshape(-1).to(torch.float32) for p in params])  # type: ignore[union-attr]
        bucket = _FlatBucket(flat, params)
        holder = self._compression_holder
        if holder is not None and holder._mover is not None:  # the residual follows its parameters (a resume)
            layout = [holder._param_index[id(p)] for p in params]
            holder._mover.enter(state, 0, layout, flat.device)
        started = getattr(state, "iter", 0) >= getattr(state, "start_iter", 0)
        sent_before = getattr(state, "bytes_sent", 0)
        reduced = hook(state, bucket).wait()
        reduced = reduced[0] if isinstance(reduced, list) else reduced
        stats = self.comm_stats
        stats.calls += 1
        stats.steps += 1
        stats.compressed_steps += int(started)
        stats.bytes_before += flat.numel() * flat.element_size()
        stats.bytes_sent += flat.numel() * 2 if self.compression in ("fp16", "bf16") else state.bytes_sent - sent_before
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(reduced[offset : offset + n].view_as(p.grad))  # type: ignore[union-attr]
            offset += n

    def bubble_per_rank(self, skip: int = 1) -> list[float | None]:
        """Every rank's measured bubble (a collective: call it on all ranks)."""
        import torch.distributed as dist

        mine = self.stats.bubble(skip)
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return gathered

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
        """Gather every stage's weights and optimizer states on rank 0; write one file there (see module doc)."""
        import torch.distributed as dist

        def cpu(x: Any) -> Any:
            return _to_cpu(x)

        mine = {
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "state_dict": cpu(checkpoint.get("state_dict", {})),
            "optimizer_states": cpu(checkpoint.get("optimizer_states", [])),
        }
        compression = self._compression_state_dict()  # a collective (every rank's residuals), before the gather
        gathered: list[Any] = [None] * self.world_size if self.is_global_zero else []
        dist.gather_object(mine, gathered if self.is_global_zero else None, dst=0)
        if not self.is_global_zero:
            return
        state: dict[str, Any] = {}
        optim: list[Any] = [None] * self.pp_size
        for part in gathered:
            if part["dp_rank"] == 0:
                state.update(part["state_dict"])
                optim[part["pp_rank"]] = part["optimizer_states"]
        checkpoint = {
            **checkpoint,
            "state_dict": state,
            "optimizer_states": optim,
            "pipeline": {
                "pipeline_ranks": self.pp_size,
                "stages": self.plan.num_stages if self.plan else 1,
                "schedule": self.schedule_name,
            },
        }
        if compression is not None:
            from lightning_accel.strategies.ddp_compression import _CHECKPOINT_KEY

            checkpoint[_CHECKPOINT_KEY] = compression
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _compression_state_dict(self) -> dict[str, Any] | None:
        """``pp_ddp``'s compressor state as ``ddp_<compression>`` saves it (None without compression); a collective."""
        if self.compression is None:
            return None
        if self._dp_hook is None and self._saved_compression is not None:  # restored, not yet applied: kept as is
            return self._saved_compression
        from dataclasses import asdict

        import torch.distributed as dist

        holder = self._holder()
        if self.comm_stats is not None:
            holder.comm_stats = self.comm_stats
        state = holder.compression_state_dict()
        # the counters differ by stage (ddp_<compression>'s are rank 0's, the same on every rank there): every rank's
        mine = asdict(holder.comm_stats)
        ranks: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return {**state, "comm_stats_of_ranks": ranks}

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.compression is not None:
            from lightning_accel.strategies.ddp_compression import _CHECKPOINT_KEY

            saved = checkpoint.get(_CHECKPOINT_KEY)
            if saved is None:
                rank_zero_warn(
                    f"pp_ddp: the checkpoint {checkpoint_path} holds no compression state (written without "
                    "compression, or by a release that did not save it): the compressor restarts from zero (Top-K's "
                    "error-feedback residuals and its warm-up, QSGD's random generator), so the resumed run differs "
                    "from an uninterrupted one"
                )
            else:
                self._saved_compression = saved
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from lightning_accel._compat import optimizers_to_device

        meta = checkpoint.get("pipeline")
        if meta is None:
            raise ValueError(
                "pipeline: the checkpoint was not written by a pp Trainer (no 'pipeline' entry), so its "
                "optimizer states are not split by stage; load its state_dict into the module and fit "
                "without ckpt_path (the optimizer starts fresh)"
            )
        if meta["pipeline_ranks"] != self.pp_size or (self.plan is not None and meta["stages"] != self.plan.num_stages):
            raise ValueError(
                f"pipeline: the checkpoint was written with {meta['pipeline_ranks']} pipeline "
                f"ranks and {meta['stages']} stages, this run has {self.pp_size} and "
                f"{self.plan.num_stages if self.plan else '?'}; resume with the same sizes (its "
                "state_dict alone loads into any run)"
            )
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"][self.pp_rank]):
            opt.load_state_dict(state)
        optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        self._schedule = None
        self._stages = []
        super().teardown()


class _FlatBucket:
    """What a DDP communication hook reads of a ``dist.GradBucket``: one flat fp32 buffer, always bucket 0."""

    def __init__(self, buffer: torch.Tensor, params: list[nn.Parameter]) -> None:
        self._buffer, self._params = buffer, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[nn.Parameter]:
        return self._params


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows (samples) of a batch tensor."""
    return t[:n] if t.dim() else t


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    if isinstance(owner, nn.ModuleList) and name.isdigit():
        owner[int(name)] = module
    else:
        setattr(owner, name, module)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items()) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj) if not hasattr(obj, "_fields") else obj
    return obj


def pp(**kwargs: Any) -> PipelineStrategy:
    """``Trainer(strategy="pp")``: every rank one pipeline stage (1F1B, micro-batches = ranks)."""
    return PipelineStrategy(**kwargs)


def pp_ddp(**kwargs: Any) -> PipelineStrategy:
    """``Trainer(strategy="pp_ddp")``: pipelines of ``pipeline_size`` ranks replicated data-parallel (default 2
    replicas from 4 processes on)."""
    kwargs.setdefault("data_parallel_size", "auto")
    return PipelineStrategy(**kwargs)
