"""The pipeline schedules the runtime runs (``torch.distributed.pipelining``'s ScheduleGPipe,
Schedule1F1B and ScheduleInterleaved1F1B): which ``(p, v, m)`` each accepts, its bubble, the
micro-batches in flight on each pipeline rank, and the point-to-point bytes of one stage
boundary. Plain Python.

Notation: ``p`` pipeline ranks (``G_pipe``), ``v`` virtual stages per rank (``p v`` stages,
"loop" placement: rank ``r`` runs stages ``r, r + p, ...``), ``m`` micro-batches per step
(``B / (G_data G_z b)``), ``t_F``, ``t_B`` one micro-batch's forward and backward through the
slowest rank (all of its ``v`` stages).

Sources: GPipe, Huang et al., arXiv 1811.06965 (bubble ``(p-1)/m`` of the ideal step, all ``m``
micro-batches in flight); 1F1B and interleaved 1F1B, Narayanan et al., arXiv 2104.04473,
section 2.2 (bubble ``(p-1)(t_F+t_B)``, ``1/v`` of it interleaved; at most ``p`` in flight);
the warm-up counts of Megatron-LM's ``schedules.py`` (``get_num_warmup_microbatches``) and
torch's ``ScheduleInterleaved1F1B`` (``warmup_ops``), which agree:
``2 (p - r - 1) + (v - 1) p`` forward chunk passes, capped at ``m v``. Constraints: torch 2.13's
``Schedule1F1B`` raises when ``m < p``; interleaving needs ``v >= 2`` and ``m % p == 0``
(Megatron's rule, which tetrad's runtime keeps) (``/work/shared/notes/pipeline-parallelism.md``
sections 1, 3 and 5).
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""The runtime's ``pipeline_schedule`` names."""


def schedule_problems(schedule: str, pipe: int, virtual: int, micro_batches: int) -> list[str]:
    """Why ``schedule`` cannot run ``p = pipe`` ranks, ``v = virtual`` stages per rank and
    ``m = micro_batches`` micro-batches (empty when it can)."""
    if schedule not in SCHEDULES:
        return [f"unknown pipeline schedule {schedule!r} (use {', '.join(SCHEDULES)})"]
    out = []
    if schedule == "interleaved-1f1b":
        if virtual < 2:
            out.append("interleaved-1f1b needs virtual stages >= 2")
        if micro_batches % pipe:
            out.append(
                f"interleaved-1f1b needs micro-batches ({micro_batches}) % pipe ({pipe}) == 0"
            )
    elif virtual != 1:
        out.append(f"{schedule} runs one stage per rank (virtual stages 1)")
    if schedule != "gpipe" and micro_batches < pipe:
        out.append(f"{schedule} needs micro-batches ({micro_batches}) >= pipe ({pipe})")
    return out


def bubble_fraction(schedule: str, pipe: int, virtual: int, micro_batches: int) -> float:
    """Bubble time over the ideal time ``m (t_F + t_B)``: ``(p-1)/m`` for GPipe and 1F1B,
    ``(p-1)/(v m)`` interleaved (Narayanan et al., arXiv 2104.04473, section 2.2)."""
    v = virtual if schedule == "interleaved-1f1b" else 1
    return (pipe - 1) / (v * micro_batches)


def bubble_seconds(schedule: str, pipe: int, virtual: int, t_fb: float) -> float:
    """Bubble seconds per step: ``(p-1)(t_F + t_B)``, ``/ v`` interleaved, where ``t_fb`` is one
    micro-batch's forward plus backward through the slowest rank (all its stages)."""
    v = virtual if schedule == "interleaved-1f1b" else 1
    return (pipe - 1) * t_fb / v


def in_flight_chunks(schedule: str, pipe: int, rank: int, virtual: int, micro_batches: int) -> int:
    """Micro-batch activations of one stage (chunk) each that pipeline rank ``rank`` holds at
    its peak, in chunk passes (a rank with ``v`` stages holds ``v`` per micro-batch in GPipe):

    - GPipe: all ``m`` micro-batches through all ``v`` chunks, ``m v``;
    - 1F1B: ``min(m, p - r)`` (stage 0 holds ``p``: Narayanan et al. section 2.2);
    - interleaved: the warm-up forwards plus the one before the first backward,
      ``min(m v, 2 (p - r - 1) + (v - 1) p + 1)`` (Megatron-LM ``schedules.py``
      ``num_warmup_microbatches``; torch ``ScheduleInterleaved1F1B`` ``warmup_ops``).
    """
    if schedule == "gpipe":
        return micro_batches * virtual
    if schedule == "1f1b":
        return min(micro_batches, pipe - rank)
    warmup = 2 * (pipe - rank - 1) + (virtual - 1) * pipe
    return min(micro_batches * virtual, warmup + 1)


def p2p_bytes(
    micro_batch: int,
    seq_len: int,
    hidden: int,
    g_context: int,
    g_x: int,
    c: int,
    sequence_split: int = 1,
) -> float:
    """Bytes one rank sends across one stage boundary per micro-batch and direction: the
    residual stream ``[b, S / G_context, h / G_x]`` forward, its gradient (same shape)
    backward, ``c`` bytes per element: the compute dtype (tetrad's stages send the residual
    stream cast to it, bf16 on CUDA, and continue in fp32:
    :class:`tetrad.pipeline.stage.StageForward`). Every (data, context, Z, Y, X) rank sends its
    own to the rank of the same coordinates in the next (previous) stage. Under sequence
    parallelism (``sequence_split = G_y``, tetrad/parallel/sequence.py) the stream is
    ``[b, S / (G_context G_y), h / G_x]``."""
    return float(micro_batch * (seq_len // g_context // sequence_split) * (hidden // g_x) * c)


def boundaries_of_rank(pipe: int, rank: int, virtual: int) -> tuple[int, int]:
    """``(forward receives, backward receives)`` per micro-batch of pipeline rank ``rank``:
    each of its ``v`` stages receives an activation unless it is stage 0, and a gradient unless
    it is the last stage ``p v - 1`` (``p v - 1`` boundaries in all)."""
    fwd = virtual - (1 if rank == 0 else 0)
    bwd = virtual - (1 if rank == pipe - 1 else 0)
    return fwd, bwd
