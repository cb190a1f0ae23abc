"""``tetrad memory --grid PIPE,DATA,CONTEXT,Z,Y,X`` (or ``pipe=4,...``): the worst pipeline
rank's memory and every rank's total (:func:`pipeline_memory_text`). Plain Python."""

from __future__ import annotations

import argparse

from tetrad.pipeline.split import PipelineSplitError
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.spec import get_machine
from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.plan.memory.pipeline import pipeline_memory
from tetrad.plan.model.spec import ModelSpec
from tetrad.plan.pipe.estimate import split_ranks
from tetrad.plan.pipe.schedule import schedule_problems
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.question import StepQuestion
from tetrad.spec import GiB, format_grid, role_sizes


def pipeline_memory_text(
    args: argparse.Namespace,
    model: ModelSpec,
    pipe: int,
    grid: tuple,
    turn: str,
    ckpt: str,
    gpu_memory_bytes: float,
) -> tuple[MemoryBreakdown, str]:
    """The worst rank's breakdown and the title of ``tetrad memory`` on a pipeline grid: the
    stage split is the runtime's (:func:`tetrad.pipeline.split.balanced_split` by the per-block
    compute of ``--machine``, default dgx-h100); ``--num-microbatches`` defaults to ``8 G_pipe``.

    Raises:
        PlanError: the schedule cannot run these sizes, or more stages than blocks.
    """
    v, sched = args.virtual_stages, args.pipeline_schedule
    m = args.num_microbatches or 8 * pipe
    if bad := schedule_problems(sched, pipe, v, m):
        raise PlanError(
            "; ".join(bad) + ": change --pipeline-schedule, --virtual-stages or --num-microbatches"
        )
    mode = ckpt.partition(":")[0]
    if mode != ckpt:
        raise PlanError("a pipeline grid takes --activation-checkpointing none, selective or full")
    machine = get_machine(args.machine or "dgx-h100")
    roles = role_sizes(grid, turn)
    ctx = StepQuestion(model, machine, args.seq_len, grid[0] * grid[2] * args.micro_batch * m)
    try:
        ranks = split_ranks(
            model.n_layers, split_costs(ctx.compute(roles, args.micro_batch), mode), pipe, v
        )
    except PipelineSplitError as e:
        raise PlanError(str(e)) from None
    worst, per_rank = pipeline_memory(
        model,
        roles,
        args.micro_batch,
        args.seq_len,
        gpu_memory_bytes,
        ranks,
        sched,
        v,
        m,
        activation_checkpointing=mode,
        shard_optimizer=getattr(args, "shard_optimizer", False),
    )
    stages = ", ".join(
        f"{r.rank}: {'+'.join(map(str, r.chunk_blocks))} blocks {mb.total / GiB:.1f} GiB"
        for r, mb in zip(ranks, per_rank, strict=True)
    )
    title = (
        f"{model.summary()}\ntetrad runtime, grid P,D,C,Z,Y,X={format_grid(pipe, grid)} "
        f"({turn}), {sched} with {v} stage(s) per rank, {m} micro-batches of "
        f"{args.micro_batch} x {args.seq_len} tokens, checkpointing {ckpt}\n"
        f"pipeline ranks (stage split by {machine.name} compute): {stages}\n"
        f"the worst rank:"
    )
    return worst, title
