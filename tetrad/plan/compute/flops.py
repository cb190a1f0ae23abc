"""FLOP counts: model FLOPs of one optimizer step, for MFU and HFU (the runtime's definition,
:meth:`tetrad.spec.model.ModelSpec.flops_per_token`), the FLOPs full recomputation adds, and
causal attention's forward FLOPs on one rank (:func:`attention_fwd_flops`, with context
parallelism's chunks: :mod:`tetrad.plan.comm.context_parallel`).
"""

from __future__ import annotations

from tetrad.plan.machine.description import Machine
from tetrad.spec.model import ModelSpec


def model_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step: ``flops_per_token(S) * B * S`` (the runtime's MFU
    numerator; recomputation excluded)."""
    return model.flops_per_token(seq_len) * global_batch * seq_len


def mfu(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    step_seconds: float,
) -> float:
    """Model FLOPs utilisation: model FLOPs per step / (step time * GPUs * peak)."""
    return model_flops_per_step(model, global_batch, seq_len) / (
        step_seconds * gpus * machine.peak_flops
    )


def recompute_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """FLOPs of recomputing every block's forward once: ``L (2 N_block + 2 S a d)`` per token
    (the forward third of :meth:`ModelSpec.flops_per_token` without the LM head)."""
    block = sum(lin.count * lin.weight_elements for lin in model.linears())
    return model.n_layers * (2.0 * block + 2.0 * seq_len * model.q_dim) * global_batch * seq_len


def attention_fwd_flops(
    model: ModelSpec, micro_batch: int, seq_len: int, gy: int, gc: int = 1
) -> float:
    """Causal attention forward FLOPs on one rank: ``2 b S^2 d a / (G_y G_context)`` (half of
    ``4 b S^2 d a`` for the causal mask: PaLM, Chowdhery et al., arXiv 2204.02311, appendix B).
    With ``G_context = G > 1`` each rank's two chunks of ``c = S / (2G)`` tokens attend over the
    keys up to their ends, ``4 b d a / G_y c^2 2G`` with the lower-right causal kernel on CUDA,
    which skips the masked half of each chunk's last ``c x c`` block: the same (derived in the
    module doc of :mod:`tetrad.plan.comm.context_parallel`)."""
    a_d = model.head_dim * model.n_heads / gy
    return 2.0 * micro_batch * seq_len * seq_len * a_d / gc
