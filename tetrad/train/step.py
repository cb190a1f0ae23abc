"""One optimizer step of 4D-parallel training, the optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from tetrad.dtypes import autocast, keep_policy, stored_policy, torch_dtype
from tetrad.grid import Grid
from tetrad.parallel import clip_grad_norm, sync_gradients
from tetrad.parallel.batch import inputs_targets, local_samples, sum_over_batch_axes, to_device
from tetrad.parallel.experts import update_expert_biases
from tetrad.parallel.masters import MasterAdamW, store_parameters
from tetrad.parallel.zero import DataShards, ShardedAdamW, optimizer_shards
from tetrad.spec.precision import Precision


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas=(0.9, 0.95),
    eps: float = 1e-8,
    shard: Grid | None = None,
    policy: Precision | None = None,
) -> torch.optim.AdamW:
    """AdamW over the local shards; weight decay on matrices only (not norms or biases).

    With a ``policy`` that stores the weights apart from their masters (``params="bf16"``,
    :attr:`tetrad.spec.precision.Precision.masters`), the optimizer keeps fp32 masters made
    from the parameters as they are now (:class:`tetrad.parallel.masters.MasterAdamW`; the
    sharded optimizer's masters are its pieces), then the model's parameters are stored in the
    policy's format with their gradients accumulated apart in fp32
    (:func:`tetrad.parallel.masters.store_parameters`): build the optimizer after the weights
    are initialised or loaded. The policy's ``grad_reduce`` format is the one the gradients are
    summed over data in. The policy is recorded on the parameters
    (:func:`tetrad.dtypes.keep_policy`): the training steps run under it (its residual stream's
    format among the rest).

    With ``shard`` (the grid), the sharded optimizer: AdamW states split over the grid's data x
    context ranks, gradients reduce-scattered and parameters all-gathered over them
    (:class:`tetrad.parallel.zero.ShardedAdamW`, ZeRO-1); the training steps find it through
    the optimizer's ``shards``.

    AdamW is elementwise, so AdamW on shards equals AdamW on the full tensors. The update runs
    as torch's fused kernel (``fused=True``: one pass over each parameter's states) on CPU and
    CUDA, as multi-tensor (``foreach``) operations elsewhere, never parameter by parameter. On
    one CPU core the fused kernel takes 7 ms per step for the ``small`` model's 5.2M parameters
    against 24 ms for ``foreach``.
    """
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    fused = bool(params) and params[0].device.type in ("cpu", "cuda")
    kwargs = {"lr": lr, "betas": betas, "eps": eps, "fused": fused}
    kwargs["foreach"] = None if fused else True
    masters = policy is not None and policy.masters
    if shard is not None:
        opt = ShardedAdamW(groups, DataShards(shard), masters=masters, **kwargs)
    elif masters:
        opt = MasterAdamW(groups, **kwargs)
    else:
        opt = torch.optim.AdamW(groups, **kwargs)
    if policy is not None:
        dtypes = (policy.params, policy.grads, policy.grad_reduce)
        store_parameters(model, *map(torch_dtype, dtypes))
        keep_policy(model, policy)  # the steps run under it (its residual stream's format)
    return opt


def lr_at(step: int, peak: float, floor: float, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps to ``peak``, then cosine decay to ``floor`` at
    ``total`` (Loshchilov and Hutter, arXiv 1608.03983, eq. 5, without restarts). ``step`` counts
    from 0."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    grid: Grid,
    batch: torch.Tensor,
    micro_batch: int,
    grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, backward and update on one global batch, with no host synchronisation.

    Args:
        batch: the global batch ``[B, S+1]`` of token ids (inputs ``[:, :-1]``, targets
            ``[:, 1:]``), the same on every rank; this rank uses its ``B/(G_data G_z)`` samples
            in micro-batches of ``micro_batch``.
    Returns:
        ``(loss, grad_norm)`` as 0-dim tensors on the grid's device (read them with
        ``float()`` or ``.tolist()`` when needed; on a GPU that waits for the step): the mean
        cross-entropy (nats) over all ``B*S`` tokens of the global batch (without an MoE
        model's load-balancing term: :func:`train_step_losses`), and the global gradient norm
        before clipping.
    """
    loss, _, norm = train_step_losses(model, optimizer, grid, batch, micro_batch, grad_clip)
    return loss, norm


def train_step_losses(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    grid: Grid,
    batch: torch.Tensor,
    micro_batch: int,
    grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`train_step`, returning ``(lm_loss, aux_loss, grad_norm)``.

    The loss differentiated is ``lm_loss + aux_loss``: ``lm_loss`` the mean cross-entropy over
    the ``B*S`` tokens, ``aux_loss`` the MoE load-balancing term, the sum over MoE blocks of
    ``aux_loss_coef`` x the mean over the ``B`` sequences of the block's Switch loss
    (:func:`tetrad.models.moe.load_balance_loss`) plus ``router_z_loss_coef`` x the block's
    router z-loss (:func:`tetrad.models.moe.router_z_loss`; 0 for a dense model). After the
    update, MoE
    routers with a selection bias update it from the step's expert loads
    (:func:`tetrad.parallel.experts.update_expert_biases`). The MoE blocks' routing statistics
    of the step stay on the device in the model
    (:meth:`tetrad.models.llama.Transformer.take_routing`, this rank's tokens only).
    """
    n_tokens, n_seqs = batch[:, 1:].numel(), batch.shape[0]
    micro_batches = to_device(local_samples(batch, grid), grid.device).split(micro_batch)
    overlap = getattr(model, "overlap", None)
    shards = optimizer_shards(optimizer)
    if shards is not None:
        shards.attach(model)
    if overlap is not None:
        overlap.buckets.shards = shards
    loss = torch.zeros((), device=grid.device)
    aux, moe = torch.zeros((), device=grid.device), False
    policy = stored_policy(model, grid.device)
    for i, mb in enumerate(micro_batches):
        if overlap is not None:
            overlap.begin_micro_batch(last=i == len(micro_batches) - 1)
        with autocast(grid.device, policy):
            part = model.loss_sum(*inputs_targets(mb, grid), grad_scale=1 / n_tokens) / n_tokens
            aux_sum = model.aux_loss_sum() if hasattr(model, "aux_loss_sum") else None
        if hasattr(model, "record_routing"):  # MoE blocks' loads, summed on the device
            model.record_routing()
        total = part if aux_sum is None else part + aux_sum / n_seqs
        total.backward()
        if overlap is not None:
            overlap.end_micro_batch()
        loss += part.detach()
        if aux_sum is not None:
            aux, moe = aux + aux_sum.detach() / n_seqs, True
    # the loss's sum over the batch axes runs behind the gradients' and the update: no rank
    # waits for the others at a collective of its own
    summed = sum_over_batch_axes(loss, grid, async_op=True)
    sync_gradients(model, grid, overlap.buckets.reduced if overlap is not None else set(), shards)
    norm = clip_grad_norm(model, grid, grad_clip, shards)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_expert_biases(model, grid)
    loss = summed.wait()
    if moe:  # a dense model's step issues the one loss all-reduce it always did
        aux = sum_over_batch_axes(aux, grid)
    return loss, aux, norm


@torch.no_grad()
def evaluate(model: nn.Module, grid: Grid, batches: list[torch.Tensor], micro_batch: int) -> float:
    """Mean cross-entropy (nats per token) over the given global batches ``[B, S+1]``."""
    total = torch.zeros((), device=grid.device)
    n_tokens, policy = 0, stored_policy(model, grid.device)
    for batch in batches:
        n_tokens += batch[:, 1:].numel()
        for mb in to_device(local_samples(batch, grid), grid.device).split(micro_batch):
            with autocast(grid.device, policy):
                total += model.loss_sum(*inputs_targets(mb, grid)).float()
    return sum_over_batch_axes(total, grid).item() / n_tokens
