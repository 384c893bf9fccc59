"""The split of a pipeline-parallel run: the network found in the LightningModule, checked on its first batch, planned
into stages, and cut down to this rank's stages. See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_accel.core.pipeline_plan import StagePlan, plan_stages
from lightning_accel.strategies.pipeline_network import (
    _Layout,
    _logits,
    _Offstage,
    _Stage,
    _UserLayout,
    find_layout,
    measure_stage_costs,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StageSplit", "check_split", "cost_probe", "find_network", "sample_batch", "split_network", "timed_costs"]

#: (embedding, blocks, head + loss): what each piece of the network costs, for the planner
Costs = tuple[float, list[float], float]


@dataclass
class StageSplit:
    """This rank's share of the network: its stage modules, and the modules of the other stages it set aside.

    Attributes:
        net_attr: the LightningModule's attribute that holds the network.
        layout: the structure found (or given by ``pipeline_layout()``).
        plan: the stages' blocks, ranks and costs.
        modules: this rank's stages, in order.
        offstage: the other stages' modules, replaced by placeholders in the network, kept (until the first batch
            is checked) so that the whole network can run once.
        tied: ``(first-stage name, last-stage name)`` of every parameter both ends hold (tied embeddings).
    """

    net_attr: str
    layout: _Layout
    plan: StagePlan
    modules: list[_Stage]
    offstage: dict[str, nn.Module]
    tied: list[tuple[str, str]]

    @contextmanager
    def whole(self) -> Iterator[None]:
        """The network with every stage's modules back in place (the other stages' placeholders after)."""
        net = self.layout.net
        swapped = {}
        for path, original in self.offstage.items():
            swapped[path] = net.get_submodule(path)
            _set_submodule(net, path, original)
        try:
            yield
        finally:
            for path, placeholder in swapped.items():
                _set_submodule(net, path, placeholder)

    def describe(self, schedule: str, microbatches: int, pipeline_ranks: int, data_parallel: int) -> str:
        """The plan as printed on rank 0."""
        layout = self.layout
        return (
            f"pp plan for {type(layout.net).__name__} ({layout.name}), {schedule}, {microbatches} micro-"
            f"batches, {pipeline_ranks} pipeline ranks x {data_parallel} data-parallel:\n"
            f"{self.plan.describe(f'{self.net_attr}.{layout.blocks}')}"
            + (f"\n  tied across first and last stage: {self.tied}" if self.tied else "")
        )


def find_network(
    module: nn.Module, network: str | None, sample: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[str, _Layout]:
    """The network's attribute and structure: ``pipeline_layout()``'s, else the one recognised, on the first two
    rows of ``sample``'s inputs (the module's own first batch) where its forward must be read."""
    attr, net = _network(module, network)
    hook = getattr(module, "pipeline_layout", None)
    first_rows = _rows(sample[0], 2) if sample is not None else None
    return attr, _UserLayout(net, hook()) if callable(hook) else find_layout(net, first_rows)


def check_unsplit(module: nn.Module) -> None:
    """Refuse a module another split already cut down to its stages."""
    if any(isinstance(m, _Offstage) for m in module.modules()):
        raise ValueError(
            f"pipeline: this {type(module).__name__} was split by another pp Trainer (its other "
            "stages' modules are gone on this rank); build the module again, or load the "
            "consolidated checkpoint into a fresh one"
        )


def _network(module: nn.Module, network: str | None) -> tuple[str, nn.Module]:
    if network is not None:
        net = getattr(module, network, None)
        if not isinstance(net, nn.Module):
            raise ValueError(f"pipeline: network={network!r} is not a module attribute of {type(module).__name__}")
        return network, net
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


def split_network(
    attr: str,
    layout: _Layout,
    inputs: torch.Tensor | None,
    *,
    num_stages: int,
    pipeline_ranks: int,
    pipeline_rank: int,
    blocks_per_stage: list[int] | None = None,
    measure: Callable[[_Layout], Costs] | None = None,
) -> StageSplit:
    """Check the structure on ``inputs`` (the module's own first batch), plan the stages (by parameter count, or by
    what ``measure`` returns) and keep this rank's: the other stages' modules are replaced by placeholders."""
    net = layout.net
    blocks = layout.block_list()
    check_split(layout, inputs)
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
    tied = [
        (first_ids[id(p)], n)
        for path in layout.last
        for n, p in net.get_submodule(path).named_parameters(prefix=path, remove_duplicate=False)
        if id(p) in first_ids
    ]
    if measure is not None:
        first_cost, costs, last_cost = measure(layout)
        unit = "µs fwd+bwd"
    else:
        costs = [float(sum(p.numel() for p in b.parameters())) for b in blocks]
        first_cost = float(sum(p.numel() for path in layout.first for p in net.get_submodule(path).parameters()))
        last_cost = float(sum(p.numel() for path in layout.last for p in net.get_submodule(path).parameters()))
        unit = "parameters"
    plan = plan_stages(
        costs,
        num_stages,
        pipeline_ranks=pipeline_ranks,
        first_cost=first_cost,
        last_cost=last_cost,
        unit=unit,
        blocks_per_stage=blocks_per_stage,
    )
    local = plan.stages_of(pipeline_rank)
    modules = [_Stage(layout, plan.blocks[s], first=s == 0, last=s == num_stages - 1) for s in local]
    # what this rank does not run is replaced by a placeholder (the names of what it runs stay the original's)
    keep_blocks = {i for s in local for i in plan.blocks[s]}
    offstage: dict[str, nn.Module] = {}
    for i in range(len(blocks)):
        if i not in keep_blocks:
            offstage[f"{layout.blocks}.{i}"] = blocks[i]
            blocks[i] = _Offstage()
    for paths, keep in ((layout.first, 0 in local), (layout.last, num_stages - 1 in local)):
        if not keep:
            for path in paths:
                offstage[path] = net.get_submodule(path)
                _set_submodule(net, path, _Offstage())
    return StageSplit(attr, layout, plan, modules, offstage, tied)


def check_split(layout: _Layout, inputs: torch.Tensor | None = None) -> None:
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


def cost_probe(
    layout: _Layout,
    sample: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    microbatches: int,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    balance_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """What ``balance="time"`` measures on (:func:`measure_stage_costs`' keywords): one micro-batch of the first
    batch with the module's loss, or synthetic token ids of ``balance_shape`` when that is given, or when there is
    no batch."""
    if balance_shape is None and sample is not None:
        inputs, targets = sample
        rows = max(1, inputs.shape[0] // microbatches) if inputs.dim() else 1
        return {"inputs": _rows(inputs, rows), "targets": _rows(targets, rows), "loss": loss}
    shape = balance_shape or (2, 8)
    if layout.synthetic_ids((1, 1)) is None:
        first = type(layout.net.get_submodule(layout.first[0])).__name__
        raise ValueError(
            f"PipelineStrategy(balance='time', balance_shape={shape!r}) measures on token ids, and "
            f"{type(layout.net).__name__}'s first piece ({first}) does not take them: leave "
            "balance_shape=None to measure on one micro-batch of the module's own first batch"
            + ("" if sample is not None else " (and give the Trainer a train loader to read it from)")
        )
    return {"shape": shape}


def timed_costs(layout: _Layout, probe: dict[str, Any], *, device: torch.device, rank: int) -> Costs:
    """``balance="time"``: rank 0 measures (embedding, blocks, head + loss) on ``probe`` (:func:`cost_probe`) and
    every rank gets its numbers, so all ranks build the same plan."""
    import torch.distributed as dist

    mine = measure_stage_costs(layout, device, **probe) if rank == 0 else None
    if dist.is_available() and dist.is_initialized():
        box = [mine]
        dist.broadcast_object_list(box, src=0)
        mine = box[0]
    assert mine is not None
    return mine


def sample_batch(
    trainer: pl.Trainer, to_pipeline_batch: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
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
        combined = CombinedLoader(loader, "max_size_cycle" if trainer.state.fn == TrainerFn.FITTING else "sequential")
        try:
            iter(combined)
            batch = next(combined)[0]
        except StopIteration:
            return None
        finally:
            combined.reset()
    return to_pipeline_batch(batch)


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
