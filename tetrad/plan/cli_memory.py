"""``tetrad memory``'s helpers beside :mod:`tetrad.plan.cli`: the grid and expert options of
``--grid``, the title's note on the weights' format, and the memory of a pipeline grid
(:func:`pipeline_memory_text`). Plain Python: no torch.
"""

from __future__ import annotations

import argparse

from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import get_machine
from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.plan.memory.pipeline import pipeline_memory
from tetrad.plan.pipe.pipeline_step import split_ranks
from tetrad.plan.pipe.schedule import schedule_problems
from tetrad.plan.pipe.stages import ranks_of_split, split_costs
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.memory_fits import sequence_parallel_memory
from tetrad.spec.grid import format_grid, parse_pipeline_grid, pop_expert, role_sizes
from tetrad.spec.model import ModelSpec
from tetrad.spec.pipeline_split import PipelineSplitError, explicit_split
from tetrad.spec.sharding import moe_grid_problem
from tetrad.spec.units import GiB


def weights_text(args: argparse.Namespace) -> str:
    """The title's note on bf16 weights (none for fp32) and on the residual stream's format
    (none for ``auto``, the compute dtype's)."""
    text = ", bf16 weights with fp32 masters" if args.param_dtype != "fp32" else ""
    residual = getattr(args, "residual_dtype", "auto")
    return text + (f", {residual} residual stream" if residual != "auto" else "")


def residual_arg(args: argparse.Namespace) -> dict:
    """``--residual-dtype`` as the ``residual`` keyword of
    :func:`tetrad.plan.memory.runtime.runtime_memory` (absent for ``auto``: the compute
    dtype's, bf16, as ``tetrad memory`` models the GPU runtime)."""
    residual = getattr(args, "residual_dtype", "auto")
    return {} if residual == "auto" else {"residual": residual}


def sequence_parallel_arg(args: argparse.Namespace) -> dict:
    """``--sequence-parallel`` (and ``--sequence-parallel-regather``) as the
    ``sequence_parallel`` keyword of :func:`tetrad.plan.memory.runtime.runtime_memory`:
    ``True``, ``"regather"``, or absent when off."""
    sp = sequence_parallel_memory(
        getattr(args, "sequence_parallel", False),
        getattr(args, "sequence_parallel_regather", False),
    )
    return {"sequence_parallel": sp} if sp else {}


def sequence_parallel_text(args: argparse.Namespace) -> str:
    """The title's note on sequence parallelism (none when off)."""
    sp = sequence_parallel_arg(args).get("sequence_parallel")
    return {True: ", sequence-parallel", "regather": ", sequence-parallel (regather)"}.get(sp, "")


def grid_and_experts(args: argparse.Namespace, model: ModelSpec) -> tuple[int, tuple, dict]:
    """``(G_pipe, the five sizes, MoE options)`` of ``tetrad memory --grid``: an ``expert=N``
    item of a named grid, else ``--expert-parallel``, and ``--moe-imbalance``, as the
    ``expert`` and ``imbalance`` keywords of :func:`runtime_memory` (empty for a dense model).

    Raises:
        PlanError: a bad ``expert=N``, one that ``--expert-parallel`` contradicts, or an
            expert axis the MoE runtime cannot run.
    """
    text, expert = args.grid, args.expert_parallel
    if "expert=" in text.replace(" ", ""):
        text, named = pop_expert(text)
        if not named.isdigit() or int(named) < 1:
            raise PlanError(f"expert={named} in --grid must be a positive whole number")
        if expert not in (1, int(named)):  # as tetrad train: the two must agree
            raise PlanError(
                f"--grid names expert={named} and --expert-parallel {expert} disagrees: keep one"
            )
        expert = int(named)
    pipe, grid = parse_pipeline_grid(text)
    if expert > 1 and (problem := moe_grid_problem(model, grid, pipe, expert)):
        raise PlanError(problem)
    if not model.is_moe:
        return pipe, grid, {}
    return pipe, grid, {"expert": expert, "imbalance": args.moe_imbalance}


def pipeline_memory_text(
    args: argparse.Namespace,
    model: ModelSpec,
    pipe: int,
    grid: tuple,
    turn: str,
    ckpt: str,
    gpu_memory_bytes: float,
    moe: dict | None = None,
) -> tuple[MemoryBreakdown, str]:
    """The worst rank's breakdown and the title of ``tetrad memory`` on a pipeline grid: the
    stage split is the runtime's (:func:`tetrad.spec.pipeline_split.balanced_split` by the per-block
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
    mode, moe = ckpt.partition(":")[0], moe or {}
    if mode != ckpt:
        raise PlanError("a pipeline grid takes --activation-checkpointing none, selective or full")
    machine = get_machine(args.machine or "dgx-h100")
    roles = role_sizes(grid, turn)
    batch = grid[0] * grid[2] * args.micro_batch * m
    ctx = StepQuestion(model, machine, args.seq_len, batch, **sequence_parallel_arg(args))
    given = getattr(args, "pipeline_split", "")
    try:
        if given:
            ranks = ranks_of_split(explicit_split(given, model.n_layers, pipe * v), pipe, v)
        else:
            costs = split_costs(ctx.compute(roles, args.micro_batch), mode)
            ranks = split_ranks(model.n_layers, costs, pipe, v)
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
        params=getattr(args, "param_dtype", "fp32"),
        **residual_arg(args),
        **moe,
        **sequence_parallel_arg(args),
    )
    stages = ", ".join(
        f"{r.rank}: {'+'.join(map(str, r.chunk_blocks))} blocks {mb.total / GiB:.1f} GiB"
        for r, mb in zip(ranks, per_rank, strict=True)
    )
    how = (
        "as given"
        if given
        else f"by {machine.name} compute{'' if args.machine else ', the default without --machine'}"
    )
    title = (
        f"{model.summary()}\ntetrad runtime, grid P,D,C,Z,Y,X={format_grid(pipe, grid)} "
        f"({turn}), {sched} with {v} stage(s) per rank, {m} micro-batches of "
        f"{args.micro_batch} x {args.seq_len} tokens, checkpointing {ckpt}{weights_text(args)}"
        f"{sequence_parallel_text(args)}\n"
        f"pipeline ranks (stage split {how}): {stages}\n"
        f"the worst rank:"
    )
    return worst, title
