"""Transient buffers of one rank of tetrad's runtime: Z-gathered weights, weight gradients before
their reduce-scatter, the fused LM head's logits, the embedding's gradient block, the
data-parallel buffers at the end of backward and the optimizer step's. Bytes; symbols as in
:mod:`tetrad.plan.memory.runtime`."""

from __future__ import annotations

from tetrad.plan.memory.formats import dtype_bytes
from tetrad.plan.memory.states import local_parameter_elements
from tetrad.spec.grid import context_size, grid_sizes
from tetrad.spec.model import Linear, ModelSpec
from tetrad.spec.overlap import loss_chunk_rows
from tetrad.spec.units import FP32


def gathered_weight_bytes(lin: Linear, grid, dtype: str = "bf16", params: str = "fp32") -> float:
    """The Z all-gathered weight block ``n k / (G_x G_y)`` in compute dtype (tetrad/parallel/
    linear.py: ``all_gather_Z(w_shard.to(dtype))``). 0 with ``G_z = 1`` when the weights are
    stored in the compute dtype (fp32 and fp32, or bf16 and bf16): the shard itself is used."""
    _, gz, gy, gx = grid_sizes(grid)
    e = dtype_bytes(dtype)
    if gz == 1 and dtype == params:
        return 0.0
    return float(e * lin.count * lin.weight_elements // (gx * gy))


def weight_gradient_bytes(lin: Linear, grid, dtype: str = "bf16") -> float:
    """The local weight gradient ``dy^T x`` ``[n/G_y, k/G_x]`` before the Z reduce-scatter: in
    compute dtype, plus its fp32 copy (the reduce-scatter input) when the compute dtype is bf16
    and ``G_z > 1`` (with ``G_z = 1`` it is added to the fp32 gradient as it is,
    tetrad/parallel/linear.py ``reduce_weight_gradient``)."""
    _, gz, gy, gx = grid_sizes(grid)
    e = dtype_bytes(dtype)
    per = e + (FP32 if e != FP32 and gz > 1 else 0)
    return float(per * lin.count * lin.weight_elements // (gx * gy))


def expert_gradient_bytes(model: ModelSpec, dtype: str = "bf16", expert: int = 1) -> float:
    """The gradient of one routed-expert weight ``[E/G_expert, f_e, h]`` as the grouped GEMM's
    backward forms it (tetrad/models/moe.py ``expert_swiglu``): in the compute dtype, plus its
    fp32 copy for ``.grad`` when the compute dtype is bf16 (the cast's backward)."""
    e = dtype_bytes(dtype)
    per = e + (FP32 if e != FP32 else 0)
    return float(per * model.n_experts // expert * model.expert_dim * model.dim)


def lm_head_logits_bytes(
    model: ModelSpec, grid, m: int, e: int, sequence_parallel: bool = False
) -> float:
    """Transients of the fused LM head and loss (tetrad/parallel/loss.py ``lm_head_loss``) at
    their largest, in forward: one block of ``n`` rows (:func:`tetrad.spec.overlap.loss_chunk_rows`,
    the GPU budget) of logits ``[n, V/(G_y G_x)]`` in the compute dtype, their fp32 softmax and
    its compute-dtype copy for the gradient GEMMs (one buffer in all when ``e = 4``; with the
    vocabulary split over Y or X each block's statistics are all-reduced before its
    gradient, so no other block's logits are kept); with ``G_x > 1`` the input gathered over X
    ``e m h`` (under ``sequence_parallel``, gathered along the sequence over Y: the same); the
    per-token maximum, sum and target logit ``12 m``."""
    _, _, gy, gx = grid_sizes(grid)
    vy = model.vocab_size // (gy * gx)
    n = loss_chunk_rows(vy, m)
    block = n * vy * (e if e == FP32 else 2 * e + FP32)
    gathered = e * m * model.dim if gx > 1 or sequence_parallel else 0
    return float(block + gathered + 12 * m)


def embedding_grad_bytes(model: ModelSpec, grid) -> float:
    """The embedding's backward builds its full-block gradient ``[V/G_y, h/G_x]`` fp32 before the
    Z reduce-scatter (tetrad/parallel/embedding.py); with ``G_z = 1`` that block is the gradient
    itself (counted with the gradients), so nothing on top."""
    _, gz, gy, gx = grid_sizes(grid)
    return float(FP32 * model.vocab_size * model.dim // (gx * gy)) if gz > 1 else 0.0


def end_of_backward_bytes(
    model: ModelSpec, grid, dp_overlap: bool = True, expert: int = 1
) -> float:
    """Temporaries at the end of backward, when the embedding's gradient is built, plus
    :func:`embedding_grad_bytes`. With ``G_data > 1`` the data-parallel all-reduce buffers:

    - ``G_z = 1`` with the ``dp_all_reduce`` overlap: the weight-gradient GEMMs write into the
      buckets' buffers (:meth:`tetrad.parallel.buckets.GradBuckets.slot`), which are the
      gradients; only the vectors (norm weights), which autograd accumulates, are copied into
      the last bucket;
    - ``G_z > 1``: ``torch.cat`` of each bucket's reduce-scattered gradients, one flat fp32 copy
      of all matrices (the vectors are summed over Z and data after backward:
      :func:`step_buffer_bytes`);
    - without the overlap ``sync_gradients`` flattens the gradients after backward, one group
      at a time (matrices, vectors): the matrices' copy, counted here.

    The gradients become views of these buffers when the last micro-batch's backward ends.
    An MoE model's routers (and its experts when ``expert = G_expert = 1``) are replicated
    over Z and data like the norm weights, so they count with the vectors; expert-sharded
    weights summed over an expert-data group of more than one rank: with the overlap their
    blocks' flat fp32 copies, all in flight at the end of backward
    (tetrad/parallel/expert_grads.py), counted here; without it, summed after backward
    (:func:`step_buffer_bytes`)."""
    gz = grid_sizes(grid)[1]
    gd = grid_sizes(grid)[0] * context_size(grid)  # the data x context group
    n = local_parameter_elements(model, grid, expert)
    if gd == 1:
        flat = 0
    elif gz == 1 and dp_overlap:
        flat = n["vectors"]
    else:
        flat = n["matrices"]
    if dp_overlap and _expert_data_summed(grid, expert):
        flat += n["experts"]
    return FP32 * flat + embedding_grad_bytes(model, grid)


def _expert_data_summed(grid, expert: int) -> bool:
    """Whether expert-sharded weights (``expert > 1``) are summed over an expert-data group
    of more than one rank (the stage's ``G_data G_context G_z G_y G_x / G_expert``)."""
    gd, gz, gy, gx = grid_sizes(grid)
    return expert > 1 and gz * gy * gx * gd * context_size(grid) // expert > 1


def step_buffer_bytes(model: ModelSpec, grid, expert: int = 1, dp_overlap: bool = False) -> float:
    """Largest temporary of the optimizer step, after backward (tetrad/train/step.py):

    - ``sync_gradients`` of the vectors (norm weights, biases; an MoE model's routers): one
      flat fp32 copy when ``G_z > 1`` (with ``G_z = 1`` their data-parallel sum rode in the
      last bucket: :func:`end_of_backward_bytes`); of the expert-sharded weights
      (``expert > 1``): one flat fp32 copy when their expert-data group (the stage's ``G_data
      G_context G_z G_y G_x / G_expert`` ranks at stride ``G_expert``, the only sum they take)
      has more than one rank, and not summed during backward already (``dp_overlap``:
      :func:`end_of_backward_bytes`). One group at a time: the larger copy counts;
    - ``clip_grad_norm``: none (``torch._foreach_norm``: one scalar per gradient; the scaling
      multiplies in place);
    - AdamW: none (torch's fused kernel, on CPU and CUDA, updates in place).
    """
    if not model.n_experts:  # a dense model: the vectors' copy only
        gz = grid_sizes(grid)[1]
        return float(FP32 * local_parameter_elements(model, grid)["vectors"] if gz > 1 else 0)
    gd, gz, gy, gx = grid_sizes(grid)
    n = local_parameter_elements(model, grid, expert)
    vectors = FP32 * n["vectors"] if gz > 1 else 0
    summed = _expert_data_summed(grid, expert) and not dp_overlap
    experts = FP32 * n["experts"] if summed else 0
    return float(max(vectors, experts))
