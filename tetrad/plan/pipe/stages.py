"""Which blocks each pipeline rank holds, as the runtime splits them: the stages of
:func:`tetrad.spec.pipeline_split.balanced_split` (the runtime's own function; for blocks of cost 1
and the embedding's and head's costs in quarter blocks, as the search asks, the same split from
its recurrence in fewer steps, :func:`tetrad.plan.pipe.uniform_split.uniform_split`) with the
planner's per-block compute seconds as cost, the embedding counted on stage 0 and the final
norm, LM head and loss on the last stage; ``p v`` stages, "loop" placement (rank ``r`` runs
stages ``r, r + p, ...``, :func:`tetrad.spec.pipeline_split.stages_of_rank`). Plain Python."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from tetrad.plan.compute.block import BlockCompute
from tetrad.plan.pipe.uniform_split import exact_quarters, uniform_split
from tetrad.spec.activation_checkpointing import checkpointed_blocks
from tetrad.spec.model import ModelSpec
from tetrad.spec.pipeline_split import balanced_split, stages_of_rank


@dataclass(frozen=True)
class PipeRank:
    """One pipeline rank's share of the model.

    Attributes:
        rank: pipeline coordinate ``r`` (0 .. ``p - 1``).
        blocks: transformer blocks over all of its ``v`` stages.
        first: it runs stage 0 (holds the embedding).
        last: it runs the last stage (final norm, LM head, loss).
        chunk_blocks: blocks of each of its stages, in execution order of the loop placement.
    """

    rank: int
    blocks: int
    first: bool
    last: bool
    chunk_blocks: tuple[int, ...]


def split_costs(comp: BlockCompute, checkpointing: str) -> tuple[float, float, float]:
    """``(block, embedding, head)`` seconds of one micro-batch, forward + backward (+ the
    block's recompute under ``checkpointing``): the costs the runtime balances stages by."""
    mode, _ = checkpointed_blocks(checkpointing, 1)
    rec = {"full": comp.block_fwd, "selective": comp.selective, "none": 0.0}[mode]
    block = comp.block_fwd + comp.block_bwd + rec
    emb = comp.embedding_fwd + comp.embedding_bwd
    head = (
        3.0 * comp.head + comp.loss_fwd + comp.loss_bwd + comp.final_norm_fwd + comp.final_norm_bwd
    )
    return block, emb, head


def pipe_ranks(
    n_layers: int, costs: tuple[float, float, float], pipe: int, virtual: int
) -> tuple[PipeRank, ...]:
    """The ``p`` ranks of :func:`balanced_stages`.

    Raises:
        tetrad.spec.pipeline_split.PipelineSplitError: ``p v`` above the blocks.
    """
    return ranks_of_split(balanced_stages(n_layers, costs, pipe * virtual), pipe, virtual)


def balanced_stages(
    n_layers: int, costs: tuple[float, float, float], n_stages: int
) -> tuple[tuple[int, int], ...]:
    """``balanced_split([block] * L, embedding, head, n_stages)`` for ``costs = (block,
    embedding, head)``: ``(start, stop)`` blocks per stage.

    Raises:
        tetrad.spec.pipeline_split.PipelineSplitError: more stages than blocks.
    """
    block, emb, head = costs
    if block == 1.0 and exact_quarters(emb, head) and 1 <= n_stages <= n_layers:
        return uniform_split(n_layers, emb, head, n_stages)  # the same, faster
    return balanced_split([block] * n_layers, emb, head, n_stages)


def ranks_of_split(split, pipe: int, virtual: int) -> tuple[PipeRank, ...]:
    """The :class:`PipeRank` of each pipeline rank for a stage split (``(start, stop)`` blocks
    per stage, ``pipe v`` stages; stage ``s`` on rank ``s mod pipe``, as the runtime places
    them)."""
    last = pipe * virtual - 1
    out = []
    for r in range(pipe):
        stages = stages_of_rank(r, pipe, virtual)
        chunks = tuple(split[s][1] - split[s][0] for s in stages)
        out.append(PipeRank(r, sum(chunks), 0 in stages, last in stages, chunks))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 12)
def stage_model(model: ModelSpec, blocks: int) -> ModelSpec:
    """``model`` with ``blocks`` blocks, one object per model and count (the memos keyed on it
    then hash it once and compare it by identity). A mixture-of-experts model's stage has no
    dense block (its first ``dense_layers`` are on one stage only; the stage of all MoE blocks
    is the one that holds the most experts). ``blocks = 0``: the LM head's stage without
    blocks (:mod:`tetrad.spec.pipeline_split`), a model of no blocks, which a user's
    :class:`~tetrad.spec.model.ModelSpec` may not be, so it is made with one and set to none."""
    more = {"dense_layers": 0} if model.n_experts else {}
    sm = dataclasses.replace(model, n_layers=max(1, blocks), **more)
    if blocks == 0:
        object.__setattr__(sm, "n_layers", 0)  # frozen; past the positive-size check
    return sm
