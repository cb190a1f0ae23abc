"""Model FLOPs of one optimizer step, for MFU and HFU (the runtime's definition,
:meth:`tetrad.spec.model.ModelSpec.flops_per_token`), and the FLOPs full recomputation adds.
"""

from __future__ import annotations

from tetrad.plan.machine.spec import Machine
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
