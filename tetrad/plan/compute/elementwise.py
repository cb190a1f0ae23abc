"""Bytes moved by the memory-bound (element-wise) work of one rank: norms, residual adds, RoPE,
the activation, the fused loss, AdamW (:data:`ELEMENTWISE`). Their time is bytes / HBM
bandwidth (:mod:`tetrad.plan.compute.block`, :class:`tetrad.plan.search.classic` beside it)."""

from __future__ import annotations

ELEMENTWISE = {
    "norm_residual_per_h": 40.0,
    "rope_per_qk": 12.0,
    "act_per_f_llama": 8.0,
    "act_per_f_gpt": 4.0,
    "loss_fwd_per_logit": 34.0,
    "loss_dw_per_block": 4.0,
    "loss_bwd_per_dx": 4.0,
    "loss_bwd_per_dw": 6.0,
    "optimizer_per_param": 36.0,
    "shard_pack_per_param": 8.0,
    "backward_factor": 2.0,
}
"""Bytes moved per element by the memory-bound parts (forward unless noted), rough counts of the
runtime's unfused ops, in bytes per token and per local feature:

- ``norm_residual_per_h`` (per ``h/G_x`` feature, per block): two RMSNorms (read fp32 input,
  write fp32 normalised, cast to bf16: ~10 B) and two residual adds (fp32 + bf16 -> fp32:
  ~10 B);
- ``rope_per_qk`` (per ``(a + k) d / G_y`` feature): fp32 rotate-half of q and k;
- ``act_per_f_*`` (per ``f/G_y`` feature): SwiGLU ``silu(gate) * up`` reads two and writes two
  bf16 tensors; GeLU one and one;
- ``loss_fwd_per_logit`` (per ``V/(G_y G_x)`` logit; the fused LM head and loss,
  tetrad/parallel/loss.py, all in forward): max of the bf16 logits (read 2), subtract into the
  fp32 softmax buffer (read 2, write 4), exp in place (8), sum (4), scale by ``1 / sum`` (8),
  cast to bf16 for the gradient GEMMs (read 4, write 2); with the vocabulary split over Y or
  X the same (the scale by ``1 / sum`` also rescales to the global maximum, once each block's
  statistics are all-reduced: no second pass);
  ``loss_dw_per_block`` (per ``dW`` element and row block after the first): the GEMM's
  accumulation reads and writes the running bf16 sum; backward ``loss_bwd_per_dx`` (per ``dx``
  element: scale, read 2, write 2) and ``loss_bwd_per_dw`` (per ``dW`` element: scaled into its
  fp32 copy, read 2, write 4). The ``dW`` terms apply where a micro-batch forms its ``dW``
  apart (``G_z > 1``); with ``G_z = 1`` the GEMM writes or adds it into the fp32 gradient
  (:meth:`tetrad.plan.compute.block.BlockCompute.over_step`);
- ``optimizer_per_param``: AdamW reads param, grad, m, v and writes param, m, v (28 B), plus the
  gradient clipping scale (8 B); per element it updates (:func:`optimizer_seconds`);
- ``shard_pack_per_param``: the sharded optimizer packs every local fp32 gradient into the
  reduce-scatter's rows (read 4, write 4; tetrad/parallel/zero.py ``DataShards.pack``);
- ``backward_factor``: backward of element-wise work moves about twice the forward's bytes.
"""


def optimizer_seconds(local: float, hbm: float, shards: int = 1, param_bytes: int = 4) -> float:
    """Seconds of the optimizer step's element-wise work on one rank holding ``local`` parameter
    elements (``hbm``: bytes/s). Without sharding: AdamW with the clipping scale
    (``optimizer_per_param`` bytes) over all of them. With the sharded optimizer over
    ``shards = G > 1`` ranks (tetrad/parallel/zero.py): AdamW over this rank's ``1/G`` piece of
    each, plus the copies of every local element that sharding adds: the gradients packed into
    the reduce-scatter's rows (``shard_pack_per_param``) and the all-gathered weights copied
    back into the parameters (read and write, ``2 param_bytes``)."""
    adamw = ELEMENTWISE["optimizer_per_param"] * local
    if shards <= 1:
        return adamw / hbm
    copies = (ELEMENTWISE["shard_pack_per_param"] + 2 * param_bytes) * local
    return (adamw / shards + copies) / hbm
