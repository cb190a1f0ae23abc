"""Stock PyTorch parallelisms of the reference Llama, the side ``benchmarks/vs_pytorch.py``
compares tetrad with (its module docstring describes each mode): DDP, FSDP2 (``fully_shard``),
1D tensor parallel (``parallelize_module``, Megatron style), FSDP2 x TP on a 2D mesh, and the
pipeline: the Llama split by hand into ``torch.distributed.pipelining.PipelineStage``s under a
stock schedule, optionally each stage replicated with DDP."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from vs_settings import SCHEDULE_LABELS, Settings

from tetrad.models.llama import ModelPart
from tetrad.models.reference import Llama
from tetrad.parallel import init_parameters
from tetrad.spec.pipeline_split import balanced_split


@dataclass(frozen=True)
class Stock:
    """A stock PyTorch mode: ``kind`` (ddp, fsdp2, tp, tp-sp, fsdp2-tp, pp), its
    tensor-parallel size ``tp``; for ``pp`` the pipeline stages ``pp``, the DDP replicas ``dp``
    of each stage and the ``schedule`` (a key of :data:`SCHEDULE_LABELS`)."""

    kind: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = ""

    def __str__(self) -> str:
        if self.kind == "pp":
            ddp = f"xDDP({self.dp})" if self.dp > 1 else ""
            return f"PP({self.pp}){ddp} {SCHEDULE_LABELS[self.schedule]}"
        names = {"ddp": "DDP", "fsdp2": "FSDP2", "tp": "TP({})", "tp-sp": "TP({})+SP"}
        names["fsdp2-tp"] = "FSDP2xTP({})"
        return names[self.kind].format(self.tp)


STOCK_KINDS = ("ddp", "fsdp2", "tp", "tp-sp", "fsdp2-tp", "pp")


@dataclass
class StockModel:
    """A parallelised reference model and its data-parallel layout."""

    model: nn.Module
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None  # None: the whole world
    parallel_loss: bool = False  # vocabulary-sharded logits: the loss needs ``loss_parallel``


def build_stock(mode: Stock, s: Settings, world: int) -> StockModel:
    """The reference Llama, initialised as tetrad's, parallelised in ``mode``."""
    model = Llama(s.cfg)
    init_parameters(model, s.seed)
    rank = dist.get_rank()
    if mode.kind == "ddp":
        return StockModel(nn.parallel.DistributedDataParallel(model), world, rank)
    if mode.kind == "fsdp2":
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        return StockModel(model, world, rank)
    if mode.kind in ("tp", "tp-sp"):
        apply_tp(model, init_device_mesh("cpu", (world,)), mode.kind == "tp-sp")
        return StockModel(model, parallel_loss=True)
    mesh = init_device_mesh("cpu", (world // mode.tp, mode.tp), mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp"])
    dp = mesh["dp"]
    return StockModel(model, dp.size(), dp.get_local_rank(), dp.get_group(), parallel_loss=True)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2: ``fully_shard`` each block, then the root."""
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def apply_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """1D tensor parallelism over ``mesh`` (see the module docstring for the plan); with
    ``sequence_parallel`` torch's ``SequenceParallel`` on the norms, the residual stream
    ``Shard(1)`` between the blocks (the embedding's output, the row-parallel projections'
    outputs), gathered before each attention, feed-forward and the LM head (torchtitan's Llama
    plan)."""
    tp = mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        w13 = getattr(block.feed_forward, "w13", None)
        if w13 is not None:  # [gate; up] -> [gate_0; up_0; gate_1; up_1 ...], a block per rank
            with torch.no_grad():
                w13.weight.copy_(by_rank(w13.weight, tp))
        parallelize_module(block, mesh, block_plan(block, sequence_parallel))
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
        if not sequence_parallel:
            replicate(block.attention_norm, mesh)
            replicate(block.ffn_norm, mesh)
    if not sequence_parallel:
        replicate(model.norm, mesh)


def by_rank(w13: torch.Tensor, tp: int) -> torch.Tensor:
    """The stacked gate/up weight ``[2f, h]`` (``[gate; up]``) with its rows ordered by TP rank,
    ``[gate_0; up_0; gate_1; up_1; ...]``, so that ``ColwiseParallel``'s contiguous row block
    ``r`` holds rank ``r``'s gate rows and their up rows, and the local output is ``[gate_r,
    up_r]``, what the model's SwiGLU reads (how a stock user fusing gate and up shards them)."""
    return w13.view(2, tp, -1, w13.shape[-1]).transpose(0, 1).reshape(w13.shape)


def block_plan(block: nn.Module, sequence_parallel: bool = False) -> dict:
    """A block's TP plan: its attention and feed-forward inputs one replicated DTensor, their
    output projections (``wo``, ``w2``) rowwise, every other projection (q, k, v, gate, up,
    separate or fused) columnwise; with ``sequence_parallel`` the inputs gathered from
    ``Shard(1)``, the rowwise outputs reduce-scattered to it, the norms ``SequenceParallel``."""
    seq = Shard(1) if sequence_parallel else Replicate()
    one_input = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    with_positions = PrepareModuleInput(  # attention also takes the plain positions tensor
        input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
    )
    plan = {"attention": with_positions, "feed_forward": one_input}
    if sequence_parallel:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    for part, out in (("attention", "wo"), ("feed_forward", "w2")):
        for name, child in getattr(block, part).named_children():
            if isinstance(child, nn.Linear):
                row = RowwiseParallel(output_layouts=seq)
                plan[f"{part}.{name}"] = row if name == out else ColwiseParallel()
    return plan


def replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``module``'s parameters replicated DTensors; it takes and returns plain tensors."""

    def to_dtensor(_module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(_module, output, _mesh):
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def stock_optimizer(model: nn.Module, s: Settings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, torch's fused kernel (``fused=True``, also on
    DTensor parameters), as :func:`tetrad.train.step.build_optimizer` builds tetrad's."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def stock_step(
    run: StockModel,
    opt: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    grad_clip: float,
) -> float:
    """Forward, backward, clip (where ``grad_clip > 0``), update on this data rank's share;
    returns the global mean loss.

    The loss is this rank's token mean: DDP and FSDP2 average gradients over data ranks, so the
    gradient is that of the mean over the global batch.
    """
    with loss_parallel() if run.parallel_loss else nullcontext():
        logits = run.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / targets.numel()
        loss.backward()
    if grad_clip > 0:  # 0: no clipping, and no norm (a stock loop that does not clip)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if run.dp_size > 1:
        dist.all_reduce(loss, group=run.dp_group)
        loss /= run.dp_size
    return float(loss)


# ---- the pipeline ------------------------------------------------------------------------------

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageModule(nn.Module):
    """A hand-split stage of the reference Llama as a stock user writes it: token ids ``[b, S]``
    (first stage) or the residual stream ``[b, S, dim]`` in; the residual stream out, or on the
    last stage the logits ``[b, S, V]`` (the schedule's ``loss_fn`` takes them)."""

    def __init__(self, part: Llama):
        super().__init__()
        self.part = part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.part.hidden(x)
        return self.part.output(h) if self.part.output is not None else h


@dataclass
class StockPipeline:
    """This rank's stage, its schedule and the layout, as :class:`StockModel` for the rest."""

    model: nn.Module  # this rank's part of the Llama (the optimizer's parameters)
    stage: PipelineStage
    schedule: ScheduleGPipe | Schedule1F1B
    pp_group: dist.ProcessGroup
    dp_size: int = 1
    dp_rank: int = 0


def build_stock_pipeline(mode: Stock, s: Settings, micro_batches: int) -> StockPipeline:
    """The reference Llama split as tetrad's Pipeline splits it by default
    (:func:`balanced_split`, blocks, embedding and head costing 1 each) into ``mode.pp``
    ``PipelineStage``s on a mesh ``("pp", "dp")`` (pipeline outermost, as tetrad's ranks), each
    stage wrapped in ``DistributedDataParallel`` over ``dp`` when ``mode.dp > 1`` (the stage then
    skips the gradient all-reduce but on the last micro-batch's backward, ``no_sync``), under
    ``mode.schedule`` with ``micro_batches`` per step. The stage's input and output shapes are
    given (``input_args``, ``output_args``), so the first step runs no shape inference."""
    mesh = init_device_mesh("cpu", (mode.pp, mode.dp), mesh_dim_names=("pp", "dp"))
    index = mesh.get_local_rank("pp")
    start, stop = balanced_split([1.0] * s.cfg.n_layers, 1.0, 1.0, mode.pp)[index]
    first, last = index == 0, index == mode.pp - 1
    part = Llama(s.cfg, part=ModelPart(start, stop, first, last))
    init_parameters(part, s.seed)
    module = StageModule(part)
    dp = mesh["dp"]
    if mode.dp > 1:
        module = nn.parallel.DistributedDataParallel(module, process_group=dp.get_group())
    b = s.batch // mode.dp // micro_batches  # example tensors; requires_grad: a gradient flows
    x = torch.zeros(b, s.seq, dtype=torch.long) if first else torch.zeros(b, s.seq, s.cfg.dim)
    x.requires_grad_(not first)
    y = torch.zeros(b, s.seq, s.cfg.vocab_size if last else s.cfg.dim, requires_grad=True)
    group = mesh["pp"].get_group()
    stage = PipelineStage(module, index, mode.pp, torch.device("cpu"), x, y, group=group)
    n_tokens = s.batch // mode.dp * s.seq  # this replica's: DDP averages over the replicas

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return loss / n_tokens

    schedule = SCHEDULES[mode.schedule](stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return StockPipeline(part, stage, schedule, group, dp.size(), dp.get_local_rank())


def stock_pipeline_step(
    run: StockPipeline,
    opt: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    grad_clip: float,
) -> float:
    """One step of the schedule on this replica's share, then what a stock user adds: the
    global gradient norm over the stages (``get_total_norm`` is this stage's; its square summed
    over ``pp``, as torchtitan's ``clip_grad_norm_``) and ``clip_grads_with_norm_`` where
    ``grad_clip > 0``, AdamW. Returns the global mean loss (the last stages' sums all-reduced
    over the world, over the replicas)."""
    losses: list[torch.Tensor] = []
    args = (tokens,) if run.stage.is_first else ()
    if run.stage.is_last:
        run.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
    else:
        run.schedule.step(*args, return_outputs=False)
    if grad_clip > 0:  # 0: no clipping, and no norm's all-reduce
        params = [p for p in run.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
        dist.all_reduce(norm, group=run.pp_group)
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm.sqrt())
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    dist.all_reduce(loss)
    return float(loss) / run.dp_size
