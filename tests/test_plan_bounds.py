"""The search's lower bounds (tetrad.plan.search.step_bounds) never exceed the estimate they stand
for, and the Z queue's floor never exceeds the Z seconds the window walk exposes."""

import dataclasses

import pytest

from tetrad.plan.comm.record import Recorder
from tetrad.plan.comm.zwindows import window_seconds, z_collectives, z_queue_seconds
from tetrad.plan.machine.description import get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.space import divisors, factorizations
from tetrad.plan.search.step_bounds import StepBounds
from tetrad.plan.step_time import estimate, make_step
from tetrad.spec.grid import role_sizes
from tetrad.spec.presets import get_model
from tetrad.spec.sharding import context_problems, grid_problems

OVERLAPS = (
    "all",
    "none",
    "prefetch",
    "prefetch,reduce_scatter",
    "reduce_scatter,dx_all_reduce,dp_all_reduce",
    "prefetch,reduce_scatter,dx_all_reduce,dp_all_reduce,domino,fine",
)
CASES = [
    # (model, machine, GPUs, global batch, sequence)
    ("gpt-20b", "perlmutter", 64, 128, 2048),
    ("llama-3.1-8b", "dgx-h100", 32, 64, 4096),
    ("llama-1b", "t3-sim", 16, 32, 1024),
    ("llama-2-70b", "frontier", 64, 64, 2048),
]


def configurations(model, gpus: int, batch: int, seq: int):
    """Every valid grid (context included) with its micro-batches and three modes."""
    for grid in factorizations(gpus, 5):
        if grid_problems(model, grid) or context_problems(seq, grid[1]):
            continue
        if batch % (grid[0] * grid[2]):
            continue
        for b in divisors(batch // (grid[0] * grid[2]))[:3]:
            for ckpt in ("none", "selective:1", "full"):
                yield grid, b, ckpt


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bounds_never_exceed_the_estimate(case):
    name, machine, gpus, batch, seq = case
    model, mc = get_model(name), get_machine(machine)
    n = 0
    for overlaps in OVERLAPS:
        ctx = StepQuestion(model, mc, seq, batch, overlaps=overlaps)
        n += check_bounds_below_estimates(ctx, gpus)
    assert n > 500


def check_bounds_below_estimates(ctx: StepQuestion, gpus: int) -> int:
    """For every configuration of ``ctx``'s question on ``gpus``: compute <= cheap bound <=
    bound with the X/Y terms <= the estimated step. Returns how many were checked."""
    bounds, n, batch = StepBounds(ctx), 0, ctx.global_batch
    for grid, b, ckpt in configurations(ctx.model, gpus, batch, ctx.seq_len):
        fwd, bwd, rec = ctx.micro_batch_seconds(grid, b, ckpt)
        compute = (batch // (grid[0] * grid[2] * b)) * (fwd + bwd + rec)
        cheap = bounds.cheap(grid, b, ckpt, compute)
        full = bounds.with_xy(cheap, grid, b, ckpt)
        step = estimate(ctx, grid, b, ckpt).step_s
        assert compute <= cheap <= full <= step * (1 + 1e-12), (ctx.overlaps, grid, b, ckpt)
        n += 1
    return n


@pytest.mark.parametrize("overlaps", OVERLAPS)
def test_z_queue_floor_is_below_the_walk(overlaps):
    model, mc = get_model("gpt-20b"), get_machine("perlmutter")
    ctx = StepQuestion(model, mc, 2048, 256, overlaps=overlaps)
    tight = 0
    for grid, b, ckpt in configurations(model, 64, 256, 2048):
        if grid[2] == 1:
            continue
        st = make_step(ctx, grid, b, ckpt, wrap=True)
        walked = Recorder(True)
        z_collectives(walked, st)
        exposed = sum(  # the weights', not the tables'
            row[4]
            for (layer, *_), row in walked.rows.items()
            if layer not in ("embedding", "positions")
        )
        windows = window_seconds(st.comp, st.n_layers, st.checkpointing)
        floor = st.acc * max(0.0, z_queue_seconds(st) - windows)
        assert floor <= exposed * (1 + 1e-12) + 1e-15, (grid, b, ckpt)
        tight += floor > 0.5 * exposed > 0
    assert tight > 0  # the floor is not vacuous


TIED = ("llama-1b:tied", "t3-sim", 16, 32, 1024)
"""llama-1b with its LM head tied to the embedding (the memory floors must not count it
twice)."""


@pytest.mark.parametrize("case", [*CASES, TIED], ids=[c[0] for c in [*CASES, TIED]])
def test_group_floor_is_below_every_member(case):
    """The 4D search's group floors (tetrad.plan.search.four_d) are at most the cheap bound of
    each configuration of the group, for every grid, orientation and optimizer variant that
    fits, under each set of overlaps; and the floor from what may fit (before the memory
    lines) is at most the floor from what fits (bounds, not estimates: a configuration a floor
    drops is one the cheap bound would drop)."""
    from tetrad.plan.question import sharded
    from tetrad.plan.search.four_d import Search4D

    name, machine, gpus, batch, seq = case
    model, mc = get_model(name.split(":")[0]), get_machine(machine)
    if name.endswith(":tied"):
        model = dataclasses.replace(model, tied_embeddings=True)
    checked = 0
    for overlaps in ("all", "none", "prefetch"):
        ctx = StepQuestion(model, mc, seq, batch, overlaps=overlaps)
        modes = ("none", "selective", "full")
        search = Search4D(ctx, gpus, mc.memory_bytes, "tetrad", "bf16", "on", modes)
        bounds = {False: StepBounds(ctx), True: StepBounds(sharded(ctx))}
        for grid, turn in search.groups():
            roles = role_sizes(grid, turn)
            fits = search.memory_fits.oriented_fits(grid, turn)
            may = search.memory_fits.may_fit(roles)
            for zero in fits.variants():
                for full, sizes in fits.classes(zero).items():  # what fits may fit
                    assert set(sizes) <= set(may[zero][full]), (grid, turn, zero, full)
                floor = search._group_floor(bounds, grid, turn, zero, fits.classes(zero))
                early = search._group_floor(bounds, grid, turn, zero, may[zero])
                assert early <= floor * (1 + 1e-12), (overlaps, grid, turn, zero)
                for lb, _, b, ckpt in search.memory_fits.expand(roles, fits, zero):
                    cheap = bounds[zero].cheap(grid, b, ckpt, lb, turn)
                    assert floor <= cheap * (1 + 1e-12), (overlaps, grid, turn, zero, b, ckpt)
                    checked += 1
    assert checked > 100


@pytest.mark.parametrize("case", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_shape_floor_is_below_its_groups(case):
    """The floor at which a tensor/context shape's 5D groups enter the queue
    (GroupFloors.shape_floor) is at most the floor of each of its groups from what may fit,
    in each optimizer variant (and so at most every configuration's step)."""
    from tetrad.plan.question import sharded
    from tetrad.plan.search.four_d import Search4D

    name, machine, gpus, batch, seq = case
    model, mc = get_model(name), get_machine(machine)
    ctx = StepQuestion(model, mc, seq, batch)
    search = Search4D(ctx, gpus, mc.memory_bytes, "tetrad", "bf16", "auto")
    bounds = {False: StepBounds(ctx), True: StepBounds(sharded(ctx))}
    checked = 0
    for grid, turn in search.groups():
        roles = role_sizes(grid, turn)
        shape = search.floors.shape_floor(roles)
        for zero, classes in search.memory_fits.may_fit(roles).items():
            floor = search._group_floor(bounds, grid, turn, zero, classes)
            assert shape <= floor * (1 + 1e-12), (grid, turn, zero)
            checked += 1
    assert checked > 20


def test_top_k_does_not_depend_on_the_order_of_offers():
    """Ties in step time go to the lower sequence number, whatever order they are offered in."""
    import random

    from tetrad.plan.search.top import offer, ranked

    items = [(float(s), n) for n, s in enumerate([3, 1, 2, 2, 5, 1, 4, 2, 3, 1])]
    want = None
    for seed in range(20):
        random.Random(seed).shuffle(items)
        best: list = []
        for step, n in items:
            offer(best, 4, step, n, n)
        got = ranked(best)
        want = want or got
        assert got == want == [(1.0, 1), (1.0, 5), (1.0, 9), (2.0, 2)]
