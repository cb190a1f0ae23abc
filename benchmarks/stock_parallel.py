"""Stock PyTorch parallelisms of the reference Llama, the side ``benchmarks/vs_pytorch.py``
compares tetrad with (its module docstring describes each mode): DDP, FSDP2 (``fully_shard``),
1D tensor parallel (``parallelize_module``, Megatron style) and FSDP2 x TP on a 2D mesh."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from tetrad.models.reference import Llama
from tetrad.parallel import init_parameters

if TYPE_CHECKING:
    from vs_jobs import Settings


@dataclass(frozen=True)
class Stock:
    """A stock PyTorch mode: ``kind`` (ddp, fsdp2, tp, fsdp2-tp) and its tensor-parallel size."""

    kind: str
    tp: int = 1

    def __str__(self) -> str:
        names = {"ddp": "DDP", "fsdp2": "FSDP2", "tp": "TP({})", "fsdp2-tp": "FSDP2xTP({})"}
        return names[self.kind].format(self.tp)


STOCK_KINDS = ("ddp", "fsdp2", "tp", "fsdp2-tp")


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
    if mode.kind == "tp":
        apply_tp(model, init_device_mesh("cpu", (world,)))
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


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """1D tensor parallelism over ``mesh`` (see the module docstring for the plan)."""
    tp = mesh.size()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan(block))
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
        replicate(block.attention_norm, mesh)
        replicate(block.ffn_norm, mesh)
    replicate(model.norm, mesh)


def block_plan(block: nn.Module) -> dict:
    """A block's TP plan: its attention and feed-forward inputs one replicated DTensor, their
    output projections (``wo``, ``w2``) rowwise, every other projection (q, k, v, gate, up,
    separate or fused) columnwise."""
    one_input = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
    )
    with_positions = PrepareModuleInput(  # attention also takes the plain positions tensor
        input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)
    )
    plan = {"attention": with_positions, "feed_forward": one_input}
    for part, out in (("attention", "wo"), ("feed_forward", "w2")):
        for name, child in getattr(block, part).named_children():
            if isinstance(child, nn.Linear):
                plan[f"{part}.{name}"] = RowwiseParallel() if name == out else ColwiseParallel()
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
    """Forward, backward, clip, update on this data rank's share; returns the global mean loss.

    The loss is this rank's token mean: DDP and FSDP2 average gradients over data ranks, so the
    gradient is that of the mean over the global batch.
    """
    with loss_parallel() if run.parallel_loss else nullcontext():
        logits = run.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / targets.numel()
        loss.backward()
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
