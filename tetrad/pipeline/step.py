"""One optimizer step, and evaluation, of a pipelined model: the pipeline analogues of
:func:`tetrad.train.step.train_step` and :func:`tetrad.train.step.evaluate`."""

from __future__ import annotations

import torch

from tetrad.comm import Handle, all_reduce
from tetrad.dtypes import autocast, stored_policy
from tetrad.grid import Grid
from tetrad.parallel import clip_grad_norm, sync_gradients
from tetrad.parallel.batch import inputs_targets, local_samples, sum_over_batch_axes, to_device
from tetrad.parallel.experts import update_expert_biases
from tetrad.parallel.zero import optimizer_shards
from tetrad.pipeline.schedule import Pipeline
from tetrad.spec.grid import Axis


def pipeline_train_step(
    pipeline: Pipeline, optimizer: torch.optim.Optimizer, batch: torch.Tensor, grad_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pipeline_train_step_losses` without the load-balancing term."""
    loss, _, norm = pipeline_train_step_losses(pipeline, optimizer, batch, grad_clip)
    return loss, norm


def pipeline_train_step_losses(
    pipeline: Pipeline, optimizer: torch.optim.Optimizer, batch: torch.Tensor, grad_clip: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward, backward and update on one global batch ``[B, S+1]`` (the same on every rank)
    through the pipeline's schedule; this rank's ``B/(G_data G_z)`` samples are its
    micro-batches.

    An MoE model's load-balancing terms are differentiated on the stages that compute them
    (:class:`tetrad.pipeline.stage.AttachAux`), and routers with a selection bias update it
    after the step (:func:`tetrad.parallel.experts.update_expert_biases`, per part).

    Returns:
        ``(loss, aux_loss, grad_norm)``, 0-dim tensors, identical on every rank: the mean
        cross-entropy (nats) over the ``B*S`` tokens, the MoE load-balancing term (as
        :func:`tetrad.train.step.train_step_losses`; 0 for a dense model), and the global
        gradient norm before clipping (all stages).
    """
    grid = pipeline.grid
    pipeline.n_tokens = batch[:, 1:].numel()
    moe = pipeline.parts[0].cfg.is_moe
    pipeline.aux_scale = 1.0 / batch.shape[0] if moe else 0.0
    local = to_device(local_samples(batch, grid), grid.device)
    shards = optimizer_shards(optimizer)
    if shards is not None:
        shards.attach(*pipeline.parts)
    for part in pipeline.parts:
        part.overlap.buckets.shards = shards
    with autocast(grid.device, stored_policy(pipeline.parts[0], grid.device)):
        loss = pipeline.step(*inputs_targets(local, grid))
    # the loss's sum runs behind the gradients' and the update (no collective of its own to
    # wait for); an MoE model's term has to wait for its routers' updates
    summed = _sum_over_pipe_and_batch_axes(loss, grid, async_op=True)
    for part in pipeline.parts:
        sync_gradients(part, grid, part.overlap.buckets.reduced, shards)
    norm = clip_grad_norm(pipeline.parts, grid, grad_clip, shards)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = summed.wait()
    aux = pipeline.aux_loss()
    if moe:
        for part in pipeline.parts:
            update_expert_biases(part, grid)
        aux = _sum_over_pipe_and_batch_axes(aux, grid)
    return loss, aux, norm


@torch.no_grad()
def pipeline_evaluate(pipeline: Pipeline, batches: list[torch.Tensor]) -> float:
    """Mean cross-entropy (nats per token) over the global batches ``[B, S+1]``, forward only
    through the schedule (every batch of the training step's shape)."""
    grid = pipeline.grid
    total = torch.zeros((), device=grid.device)
    n_tokens = 0
    pipeline.n_tokens = 1
    for batch in batches:
        n_tokens += batch[:, 1:].numel()
        local = to_device(local_samples(batch, grid), grid.device)
        with autocast(grid.device, stored_policy(pipeline.parts[0], grid.device)):
            total += pipeline.step(*inputs_targets(local, grid))
    return _sum_over_pipe_and_batch_axes(total, grid).item() / n_tokens


def _sum_over_pipe_and_batch_axes(
    t: torch.Tensor, grid: Grid, async_op: bool = False
) -> torch.Tensor | Handle:
    sum_over_batch_axes(t, grid)
    return all_reduce(t, grid, Axis.PIPE, async_op=async_op)  # only the last stage's is not 0
