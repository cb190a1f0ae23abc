"""Each pipeline stage's forward and backward seconds per micro-batch, from its rank's
(:class:`tetrad.plan.pipe.pipeline_step.RankTime`): what :mod:`tetrad.plan.pipe.critical_path`
takes. Plain Python.

A rank of ``v`` stages spends, per micro-batch, ``F_r`` forward compute, ``B_r + R_r`` backward
compute and recomputation, ``X_r`` exposed per-micro-batch collectives and ``P_r`` point-to-point
receives. Stage ``s`` of it (``n_s`` blocks) gets:

- forward: the share ``(n_s c_F + [s = 0] e_F + [s last] h_F) / F_r`` of ``F_r`` (``c_F``,
  ``e_F``, ``h_F`` the forward compute of a block, of the embedding, and of the final norm, LM
  head and loss), the same share of ``X_r F_r / (F_r + B_r + R_r)`` (collectives in proportion
  to the compute they belong to), and one activation receive unless it is stage 0;
- backward: likewise with the backward and recomputation compute, and one gradient receive
  unless it is the last stage.

Over a rank's stages these add up to its ``T_r`` (:attr:`RankTime.per_micro_batch`).
"""

from __future__ import annotations

from tetrad.plan.compute.block import BlockCompute
from tetrad.plan.pipe.schedule import boundaries_of_rank


def stage_compute(comp: BlockCompute, ckpt: str, blocks: int, first: bool, last: bool):
    """``(forward, backward + recompute)`` compute seconds of one micro-batch through a stage of
    ``blocks`` blocks, with the embedding where ``first`` and the final norm, LM head and loss
    where ``last`` (as :func:`tetrad.plan.pipe.pipeline_step.rank_time` counts them)."""
    fwd = blocks * comp.block_fwd
    bwd = blocks * comp.block_bwd + comp.micro_batch_seconds(blocks, ckpt)[2]
    if first:
        fwd, bwd = fwd + comp.embedding_fwd, bwd + comp.embedding_bwd
    if last:
        fwd += comp.final_norm_fwd + 3.0 * comp.head + comp.loss_fwd
        bwd += comp.final_norm_bwd + comp.loss_bwd
    return fwd, bwd


def stage_times(comp: BlockCompute, ckpt: str, ranks, times, pipe: int, virtual: int):
    """``(fwd, bwd)``: per stage ``s`` (0 .. ``pipe virtual - 1``), its forward and backward
    seconds per micro-batch (module doc) from the ranks' :class:`PipeRank` ``ranks`` and
    :class:`RankTime` ``times``, ``comp`` the compute of one block on the rank's grid."""
    n = pipe * virtual
    fwd, bwd = [0.0] * n, [0.0] * n
    for prank, t in zip(ranks, times, strict=True):
        r = prank.rank
        stages = range(r, n, pipe)
        parts = [
            stage_compute(comp, ckpt, k, s == 0, s == n - 1)
            for s, k in zip(stages, prank.chunk_blocks, strict=True)
        ]
        all_f = sum(f for f, _ in parts)
        all_b = sum(b for _, b in parts)
        work = t.fwd + t.bwd + t.rec
        exposed = sum(t.exposed.values())
        x_f = exposed * t.fwd / work if work > 0 else 0.0
        rank_f, rank_b = t.fwd + x_f, t.bwd + t.rec + exposed - x_f
        f_in, b_in = boundaries_of_rank(pipe, r, virtual)
        one = t.p2p / (f_in + b_in) if f_in + b_in else 0.0
        for s, (f, b) in zip(stages, parts, strict=True):
            fwd[s] = rank_f * (f / all_f if all_f > 0 else 1.0 / virtual)
            bwd[s] = rank_b * (b / all_b if all_b > 0 else 1.0 / virtual)
            fwd[s] += one if s > 0 else 0.0
            bwd[s] += one if s < n - 1 else 0.0
    return fwd, bwd
