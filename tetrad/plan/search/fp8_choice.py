"""``tetrad plan --fp8 auto``: the 4D search once per FP8 recipe (:data:`tetrad.plan.compute.fp8.
FP8_RECIPES`), the fastest kept, and a line per recipe saying whether FP8 wins against bf16's
best and by how much (:func:`plan_fp8_auto`); and the breakdown of one 4D configuration's step
beside bf16's (:func:`fp8_breakdown`): the block Linears' GEMMs, the casts, the weights' Z
all-gathers and the amax all-reduces.

Memory is the same under every recipe (:mod:`tetrad.plan.compute.fp8`), so each search ranks the
same fitting configurations; only their times differ.
"""

from __future__ import annotations

from tetrad.plan.compute.fp8 import FP8_RECIPES
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.plan import plan
from tetrad.plan.search.rows import SearchResult
from tetrad.plan.step_time import estimate
from tetrad.spec.model import ModelSpec


def plan_fp8_auto(
    model: ModelSpec, machine: Machine, gpus: int, global_batch: int, seq_len: int, **opts
) -> tuple[SearchResult, list[str]]:
    """:func:`tetrad.plan.search.plan.plan` with ``fp8`` ``off``, ``tensorwise`` and
    ``rowwise`` (``opts``: its other keywords): the result whose best 4D row is fastest, and one
    line per FP8 recipe, ``fp8 tensorwise: 1.23x bf16's best (...)`` (the ratio of bf16's best
    step seconds to the recipe's). Where FP8 is not modelled (a machine without FP8 GEMMs, a
    mixture-of-experts model, the axonn comm model) the bf16 result and one line saying why.

    Raises:
        PlanError: bad inputs, or nothing fits (as :func:`plan`).
    """
    base = plan(model, machine, gpus, global_batch, seq_len, fp8="off", **opts)
    why = ""
    if not machine.has_fp8:
        why = f"machine {machine.name} ({machine.gpu}) describes no FP8 GEMMs"
    elif model.is_moe:
        why = f"not modelled for mixture-of-experts models ({model.name})"
    elif opts.get("comm_model", "tetrad") != "tetrad":
        why = "modelled with --comm-model tetrad only"
    if why:
        return base, [f"fp8: {why}; bf16 only"]
    ref = base.rows[0]
    best, lines = base, []
    for recipe in FP8_RECIPES[1:]:
        try:
            got = plan(model, machine, gpus, global_batch, seq_len, fp8=recipe, **opts)
        except PlanError as e:
            lines.append(f"fp8 {recipe}: not searched ({e})")
            continue
        row = got.rows[0]
        ratio = ref.step_s / row.step_s
        verdict = "wins" if ratio > 1.0 else "does not win"
        lines.append(
            f"fp8 {recipe}: {ratio:.2f}x bf16's best ({verdict}: {row.step_s:.3f} s/step on "
            f"{row.label()} mb{row.micro_batch} {row.activation_checkpointing} against "
            f"{ref.step_s:.3f} s on {ref.label()} mb{ref.micro_batch} "
            f"{ref.activation_checkpointing})"
        )
        if row.step_s < best.rows[0].step_s:
            best = got
    pick = best.inputs["fp8"]
    lines.append(f"fp8 auto: the fastest is {'bf16 (off)' if pick == 'off' else pick}")
    return best, lines


def fp8_breakdown(
    model: ModelSpec,
    machine: Machine,
    grid: tuple[int, ...],
    micro_batch: int,
    checkpointing: str,
    seq_len: int,
    global_batch: int,
    *,
    orientation: str = "xy",
    shard_optimizer: bool = False,
    recipes: tuple[str, ...] = FP8_RECIPES,
) -> dict[str, dict[str, float]]:
    """Per recipe, the step of one 4D configuration (no pipeline) and its FP8 terms, seconds
    per step: ``step``, ``compute``, ``linear_gemms`` (the block Linears' three GEMMs, casts
    included), ``casts``, ``z_gather`` and ``z_gather_exposed`` (the block Linears' weight
    all-gathers), ``amax`` (the amax all-reduces, all exposed), ``exposed`` (all
    communication); ``shard_optimizer``: with the sharded optimizer
    (:func:`tetrad.plan.question.sharded`).

    Raises:
        PlanError: the batch does not split on the grid, or FP8 on a machine without it.
    """
    out = {}
    for recipe in recipes:
        ctx = StepQuestion(model, machine, seq_len, global_batch, fp8=recipe)
        if shard_optimizer:
            ctx = sharded(ctx)
        est = estimate(ctx, grid, micro_batch, checkpointing, orientation=orientation, detail=True)
        comp = ctx.compute(grid, micro_batch)
        L, acc = model.n_layers, est.grad_accum
        full = checkpointing == "full"
        names = {lin.name for lin in model.linears()}
        gathers = [
            c
            for c in est.collectives
            if c.layer in names and c.axis == "z" and c.kind == "all_gather"
        ]
        amax = [c for c in est.collectives if c.layer.endswith(" amax")]
        out[recipe] = {
            "step": est.step_s,
            "compute": est.compute_s,
            "linear_gemms": acc * L * (4.0 if full else 3.0) * sum(comp.gemm),
            "casts": acc * L * comp.casts * ((4.0 / 3.0) if full else 1.0),
            "z_gather": sum(c.calls * c.time_s for c in gathers),
            "z_gather_exposed": sum(c.exposed_s for c in gathers),
            "amax": sum(c.exposed_s for c in amax),
            "exposed": sum(est.exposed_s.values()),
        }
    return out
