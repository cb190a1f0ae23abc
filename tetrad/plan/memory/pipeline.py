"""Per-GPU memory of a pipeline grid ``(G_pipe, G_data, G_context, G_z, G_y, G_x)``: every
pipeline rank's :func:`tetrad.plan.memory.runtime.tetrad` estimate for its own blocks, with the
micro-batches its schedule keeps in flight (:func:`pipeline_memory`); the worst rank decides the
fit (80% of GPU memory, Fujii et al., arXiv 2411.06465). Plain Python, bytes.

Per pipeline rank ``r`` holding ``k`` blocks over its ``v`` stages
(:class:`tetrad.plan.pipe.stages.PipeRank`):

- parameters, gradients and AdamW states (16 bytes per local element) of its blocks, plus the
  embedding tables on the rank of stage 0 and the final norm and LM head on the rank of the last
  stage (a tied head is counted as the embedding's copy there);
- every phase of the runtime's model on a ``k``-block model; the LM head's two phases only on
  the last stage's rank, the embedding's saved input only on stage 0's;
- ``n_r / v - 1`` more micro-batches' saved activations (its blocks', and the embedding's on
  stage 0) in every phase up to the end of backward, where ``n_r`` is
  :func:`tetrad.plan.pipe.schedule.in_flight_chunks` (GPipe ``m v``; 1F1B ``min(m, p - r)``;
  interleaved Megatron's warm-up + 1), in chunk passes of ``1/v`` of its blocks each.

Not counted (as without a pipeline, the 20% margin): the point-to-point receive buffers (two
``[b, S/G_context, h/G_x]`` tensors per stage).
"""

from __future__ import annotations

import dataclasses
import functools

from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.plan.memory.runtime import phase_components
from tetrad.plan.model.grids import grid_sizes
from tetrad.plan.model.spec import ModelSpec
from tetrad.plan.pipe.schedule import in_flight_chunks
from tetrad.plan.pipe.stages import PipeRank

HEAD_PHASES = ("forward: LM head", "backward: LM head")
"""The runtime model's phases that exist only on the rank of the last stage."""
ENDS = ("backward: end", "optimizer step")
"""Phases after the last micro-batch's backward: no other micro-batch is in flight."""


def _table_elements(model: ModelSpec, grid) -> tuple[int, int, int]:
    """``(embedding, LM head, final norm)`` local elements, as :mod:`tetrad.plan.memory.states`
    counts them (``n k / (G_x G_y G_z)`` per table, ``h / G_x`` for the norm)."""
    _, gz, gy, gx = grid_sizes(grid)
    shard = gx * gy * gz
    emb = model.vocab * model.hidden // shard
    if model.max_positions:
        emb += model.max_positions * model.hidden // shard
    head = model.vocab * model.hidden // shard
    return emb, head, model.norm_params() // gx


@functools.lru_cache(maxsize=1 << 14)
def stage_parts(
    model: ModelSpec,
    blocks: int,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    ckpt: str,
    dtype: str,
    prefetch: bool,
) -> tuple:
    """The runtime model's static components, phases and saved activations of a ``blocks``
    model (memoised: the ranks of a pipeline share them)."""
    sm = dataclasses.replace(model, n_layers=blocks)
    opts = {"activation_checkpointing": ckpt, "dtype": dtype}
    static, phases = phase_components(sm, grid, micro_batch, seq_len, prefetch=prefetch, **opts)
    saved = saved_activations(sm, grid, micro_batch, seq_len, **opts)
    return static, phases, saved


def stage_memory(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    prank: PipeRank,
    in_flight: int,
    virtual: int,
    *,
    activation_checkpointing: str = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
) -> MemoryBreakdown:
    """The memory of pipeline rank ``prank`` (module doc) with ``in_flight`` chunk passes in
    flight, ``grid`` the 5D roles' sizes.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    static, phases, saved = stage_parts(
        model,
        prank.blocks,
        tuple(grid),
        micro_batch,
        seq_len,
        activation_checkpointing,
        dtype,
        prefetch,
    )
    static = dict(static)
    emb_el, head_el, final_norm = _table_elements(model, grid)
    drop = (0 if prank.first else emb_el) + (0 if prank.last else head_el + final_norm)
    add = head_el if prank.last and not prank.first and model.tied_embeddings else 0
    for name, per in (("parameters", 4), ("gradients", 4), ("optimizer_states", 8)):
        static[name] += per * (add - drop)
    emb_saved = saved["embedding"] if prank.first else 0.0
    extra = (in_flight / virtual - 1.0) * (saved["blocks"] + emb_saved)
    live: dict[str, dict[str, float]] = {}
    for name, comps in phases.items():
        if name in HEAD_PHASES and not prank.last:
            continue
        comps = dict(comps)
        if "activations" in comps and not prank.first:
            comps["activations"] -= saved["embedding"]
        if name not in ENDS:
            comps["activations"] = comps.get("activations", 0.0) + extra
        live[name] = comps
    base = sum(static.values())
    totals = {name: base + sum(c.values()) for name, c in live.items()}
    peak = max(totals, key=lambda k: totals[k])
    zero = dict.fromkeys(
        (
            "activations",
            "logits_and_loss",
            "recompute_activations",
            "gathered_weights",
            "reduce_scatter_buffers",
            "step_buffers",
        ),
        0.0,
    )
    return MemoryBreakdown(
        components={**static, **zero, **live[peak]},
        gpu_memory_bytes=float(gpu_memory_bytes),
        peak_phase=f"stage rank {prank.rank}: {peak}",
        phases=totals,
    )


def pipeline_memory(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    ranks: tuple[PipeRank, ...],
    schedule: str,
    virtual: int,
    micro_batches: int,
    *,
    activation_checkpointing: str = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
) -> tuple[MemoryBreakdown, list[MemoryBreakdown]]:
    """``(worst rank's breakdown, every rank's)`` of a pipeline of ``len(ranks)`` ranks under
    ``schedule`` with ``micro_batches`` per step (module doc).

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    pipe = len(ranks)
    out = []
    for r in ranks:
        n = in_flight_chunks(schedule, pipe, r.rank, virtual, micro_batches)
        out.append(
            stage_memory(
                model,
                grid,
                micro_batch,
                seq_len,
                gpu_memory_bytes,
                r,
                n,
                virtual,
                activation_checkpointing=activation_checkpointing,
                dtype=dtype,
                prefetch=prefetch,
            )
        )
    return max(out, key=lambda mb: mb.total), out
